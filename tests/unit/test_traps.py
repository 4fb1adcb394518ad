"""The traps of plain TRL on XLA are listed once (``train/trainer.py``'s docstring) and named everywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "lowmem_tpu" / "train" / "trainer.py"
NAME = r"`{0,2}([a-z0-9]+(?:-[a-z0-9]+)+)`{0,2}"  # a trap's name has a hyphen, in backticks or not
MENTION = re.compile(rf"\btraps? {NAME}(?: and {NAME})?", re.IGNORECASE)


def listed() -> list[str]:
    doc = ast.get_docstring(ast.parse(TRAINER.read_text())) or ""
    return re.findall(r"^- ``([a-z0-9-]+)``: ", doc, re.MULTILINE)


def mentions() -> dict[str, set[str]]:
    """Trap names mentioned outside the list, by file."""
    files = [*ROOT.glob("lowmem_tpu/**/*.py"), *ROOT.glob("docs/*.md"), *ROOT.glob("tests/**/*.py")]
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        if path == TRAINER:
            text = text.split('"""', 2)[2]  # the code after the docstring
        assert not re.search(r"\btraps? \d", text, re.IGNORECASE), f"{path}: a trap by number, not by name"
        names = {name for match in MENTION.findall(text) for name in match if name}
        if names:
            found[str(path.relative_to(ROOT))] = names
    return found


def test_the_traps_are_listed_once_with_a_name_each():
    names = listed()
    assert len(names) >= 8 and len(names) == len(set(names)), names


def test_every_trap_named_in_code_or_docs_is_listed_and_every_listed_one_is_named():
    names, found = set(listed()), mentions()
    unknown = {path: sorted(used - names) for path, used in found.items() if used - names}
    assert unknown == {}
    assert names - set().union(*found.values()) == set()


def test_the_architecture_doc_points_at_the_list_with_the_same_names():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert [name for name in listed() if f"`{name}`" not in doc] == []
