"""The layout's rules, read from the source: who may import what, module size, no cycles, light start-up."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lowmem_tpu"
MAX_LINES = 400

# Which of our parts each part may import (besides the basic modules, which import nothing of ours but
# ``errors``, ``hosts`` and ``console``). ``run`` and ``cli`` compose everything.
MAY_IMPORT = {
    "config": {"config"},
    "model": {"config", "model"},
    "data": {"config", "data"},
    "xla": {"config", "model", "xla"},
    "train": {"config", "model", "data", "xla", "train"},
    # The planner: arithmetic on the config and the recipe (the caller reads the model's config).
    "memory": {"config", "memory"},
    # The real step traced, compiled or run in subprocesses: it composes the parts that build it.
    "measure": {"config", "model", "data", "xla", "train", "preflight", "memory", "measure"},
    "publish": {"config", "model", "publish"},
    "doctor": {"config", "xla"},
    "infer": {"config", "model", "data", "xla", "train", "publish", "preflight", "infer"},
    # What this machine must have before a command: asked by commands, never by the parts they run.
    "preflight": {"config", "model", "publish", "xla"},
}
BASICS = {"errors", "files", "console", "hosts", "faults", "machine"}


def modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute module names imported by a file (every import, or only those run when it is imported)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_torch_xla_is_imported_from_the_xla_folder_only():
    offenders = [
        name
        for name, path in modules().items()
        if part(name) != "xla" and any(m.split(".")[0] == "torch_xla" for m in imports(path))
    ]
    assert offenders == []


def test_jax_is_imported_by_the_tpu_compiler_and_the_pallas_lowering_only():
    """jax and jaxlib (a second XLA beside torch_xla's) are imported by exactly two modules, both inside
    functions (importing either loads no jax), both run only by ``memory --compile``: ``measure.libtpu``, the
    one module of ``measure`` that imports jax (libtpu's compile-only client, in its own subprocess, never
    beside torch_xla), and ``xla.pallas``, which makes torch_xla's Pallas kernels lower for a TPU inside the
    trace's subprocess (it acts on torch_xla's kernel tracing, so it stays in ``xla``)."""
    jax = ("jax", "jaxlib")
    offenders = {name: path for name, path in modules().items() if any(m.split(".")[0] in jax for m in imports(path))}
    assert sorted(offenders) == ["lowmem_tpu.measure.libtpu", "lowmem_tpu.xla.pallas"]
    at_import = {
        n for n, p in offenders.items() if any(m.split(".")[0] in jax for m in imports(p, top_level_only=True))
    }
    assert at_import == set()


def test_each_part_imports_only_what_it_may():
    ours = set(modules())
    problems = []
    for name, path in modules().items():
        own = part(name)
        if own not in MAY_IMPORT:
            continue
        for imported in imports(path):
            if imported in ours and imported != "lowmem_tpu":
                target = part(imported)
                if target not in MAY_IMPORT[own] | BASICS:
                    problems.append(f"{name} imports {imported}")
    assert problems == []


def test_basic_modules_import_nothing_of_ours_but_errors_hosts_and_console():
    """``hosts`` (which host of a pod slice this is) is asked by the console before it prints; ``files`` formats
    sizes with the console's ``size``."""
    allowed = ("lowmem_tpu.errors", "lowmem_tpu.hosts", "lowmem_tpu.console")
    for basic in BASICS:
        ours = {m for m in imports(PACKAGE / f"{basic}.py") if m.startswith("lowmem_tpu")}
        ours -= {"lowmem_tpu"}  # "from lowmem_tpu import hosts"
        assert all(m.startswith(allowed) for m in ours), (basic, ours)


def test_no_module_is_over_the_size_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("every", [False, True], ids=["module-level", "every-import"])
def test_imports_have_no_cycle(every):
    """No cycle among module-level imports, nor once every import is an edge: deferred ones inside functions
    and ``if TYPE_CHECKING:`` ones too (either kind can hide a cycle a module-level graph does not show)."""
    ours = set(modules())
    graph = {
        name: {m for m in imports(path, top_level_only=not every) if m in ours} - {name}
        for name, path in modules().items()
    }
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


HEAVY = ("torch", "torch_xla", "jax", "jaxlib", "transformers")


def _reached(start: str) -> dict[str, set[str]]:
    """Every package outside ours that ``start`` may import at any depth (each import counts: deferred,
    ``if TYPE_CHECKING:``, and the ``__init__`` of each package on the way), with our modules importing it."""
    ours = modules()
    seen, todo, outside = set(), [start], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in ours]
        for imported in imports(ours[name]):
            if imported in ours:
                todo.append(imported)
            elif imported.split(".")[0] != "lowmem_tpu":
                outside.setdefault(imported.split(".")[0], set()).add(name)
    return outside


def test_the_planner_reaches_no_torch_xla_jax_or_transformers_at_any_depth():
    """memory/ is arithmetic on the config and the recipe: no import of it, at any depth (through config or
    anything else of ours, inside functions included), reaches torch, torch_xla, jax or transformers."""
    planner = [name for name in modules() if part(name) == "memory"]
    assert len(planner) > 5
    heavy = {name: {k: sorted(v) for k, v in _reached(name).items() if k in HEAVY} for name in planner}
    assert {name: found for name, found in heavy.items() if found} == {}


def test_the_planner_imports_with_torch_xla_jax_and_transformers_absent():
    """Every module of memory/ imports in a Python where torch, torch_xla, jax, jaxlib and transformers cannot
    be imported (each refused by a finder placed before the others)."""
    code = f"""
import importlib, pkgutil, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError(name + " is refused: the planner must not import it")

sys.meta_path.insert(0, Refuse())
import lowmem_tpu.memory

for info in pkgutil.iter_modules(lowmem_tpu.memory.__path__, "lowmem_tpu.memory."):
    importlib.import_module(info.name)
    print(info.name)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(done.stdout.split())
    assert imported == {name for name in modules() if part(name) == "memory" and name != "lowmem_tpu.memory"}


def _members(folder: Path) -> list[str]:
    """The modules and sub-packages of one package folder, by name."""
    files = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
    return sorted(files + [p.name for p in folder.iterdir() if (p / "__init__.py").exists()])


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def test_every_folder_says_what_it_owns_and_names_each_of_its_modules():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        where = init.relative_to(PACKAGE.parent)
        assert len(doc) > 80, f"{where} needs a docstring on what its folder owns"
        missing = [name for name in _members(init.parent) if not _named(name, doc)]
        assert missing == [], f"{where}: its docstring names no {', '.join(missing)}"


def _entries(doc: str) -> dict[str, str]:
    """The map of docs/architecture.md, by entry: ``config/``, ``preflight.py``, ``basic modules``, ... -> its text
    (an entry is a line starting at the left margin or after ``->``, with the indented lines under it)."""
    block = doc.split("```", 2)[1]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        head = re.match(r"^(?:  -> )?(\S+(?: modules)?)\s{2,}", line)
        if head and not line.startswith(" " * 8):
            name = head.group(1)
        if name:
            entries[name] = entries.get(name, "") + " " + line
    return entries


def test_the_architecture_doc_names_every_module_in_its_folders_entry():
    entries = _entries((PACKAGE.parent / "docs" / "architecture.md").read_text())
    missing = []
    for name, path in modules().items():
        parts = name.split(".")[1:]
        if not parts or parts[-1] == "__main__":
            continue
        if path.name == "__init__.py" and len(parts) == 1:  # a folder: it has its own entry
            missing += [] if f"{parts[0]}/" in entries else [name]
            continue
        entry = f"{parts[0]}/" if len(parts) > 1 else (f"{parts[0]}.py" if f"{parts[0]}.py" in entries else "basic")
        text = entries.get(entry) or entries.get("basic modules", "")
        if not _named(parts[-1], text):
            missing.append(name)
    assert missing == []


def test_no_function_is_over_80_lines():
    long = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    }
    assert long == {}


def test_only_the_hosts_module_knows_which_host_this_is():
    """Under SPMD, HF Trainer and accelerate say "process 0 of 1" on every host of a pod slice: never ask them."""
    asks = ("process_index", "is_world_process_zero", "is_local_process_zero", "world_size", "global_ordinal")
    offenders = {
        name
        for name, path in modules().items()
        if name not in ("lowmem_tpu.hosts", "lowmem_tpu.xla.runtime") and any(a in path.read_text() for a in asks)
    }
    assert offenders == set()
