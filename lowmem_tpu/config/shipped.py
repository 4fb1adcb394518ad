"""The shipped recipes as a user sees them: each one's purpose and target, and a copy to edit.

A copy brings its ``extends`` chain along (the parents are written beside it under their own
names), so it validates wherever it is written and keeps every comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from lowmem_tpu.config.methods import method_for_format
from lowmem_tpu.config.read import shipped_recipes
from lowmem_tpu.errors import UserError


@dataclass(frozen=True)
class ShippedRecipe:
    """A shipped recipe: its name, file, first header line, ``runtime.target`` and command (sft or dpo)."""

    name: str
    path: Path
    purpose: str
    target: str | None
    command: str = "sft"


def _chain(path: Path) -> list[Path]:
    """The recipe file and the files its ``extends`` names, child first."""
    chain = [path]
    while True:
        data = yaml.safe_load(chain[-1].read_text()) or {}
        parent = data.get("extends")
        if not parent:
            return chain
        chain.append((chain[-1].parent / parent).resolve())


def describe_shipped() -> list[ShippedRecipe]:
    """Every shipped recipe with the first line of its header comment and its target (through ``extends``)."""
    from lowmem_tpu.config.read import read_recipe_file

    out = []
    for name, path in shipped_recipes().items():
        header = next((line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        data = read_recipe_file(path)
        command = data.get("method") or method_for_format(data.get("data", {}).get("format", "chat"))
        out.append(ShippedRecipe(name, path, header, data.get("runtime", {}).get("target"), command))
    return out


def copy_recipe(name: str, dest: Path, force: bool = False) -> list[Path]:
    """Write the shipped recipe ``name`` to ``dest`` (a file, or a directory to put NAME.yaml in), parents beside it."""
    shipped = shipped_recipes()
    key = name.removesuffix(".yaml").removeprefix("recipes/")
    if key not in shipped:
        raise UserError(f"recipes copy: no shipped recipe {name!r}; shipped: {', '.join(shipped)}")
    as_file = dest.suffix in (".yaml", ".yml") and not dest.is_dir()
    target = dest if as_file else dest / f"{key}.yaml"
    if target.parent.exists() and not target.parent.is_dir():
        raise UserError(f"recipes copy: {target.parent} is a file, not a directory")
    chain = _chain(shipped[key])
    files = [(chain[0], target)] + [(parent, target.parent / parent.name) for parent in chain[1:]]
    existing = [str(out) for _, out in files if out.exists()]
    if existing and not force:
        verb = "exists" if len(existing) == 1 else "exist"
        raise UserError(f"recipes copy: {', '.join(existing)} already {verb}; pass --force to replace them")
    if target.name in {parent.name for parent in chain[1:]}:
        raise UserError(f"recipes copy: {target.name} is the name of a recipe it extends; choose another file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    for source, out in files:
        out.write_text(source.read_text())
    return [out for _, out in files]
