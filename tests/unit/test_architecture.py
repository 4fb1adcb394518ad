"""The layout's rules, read from the source: who may import what, module size, no cycles, light start-up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lowmem_tpu"
MAX_LINES = 400

# Which of our parts each part may import (besides ``errors``, ``files`` and ``console``, which import
# nothing of ours). ``sft`` and ``cli`` compose everything.
MAY_IMPORT = {
    "config": {"config"},
    "model": {"config", "model"},
    "data": {"config", "data"},
    "xla": {"config", "model", "xla"},
    "train": {"config", "model", "data", "xla", "train"},
    "evaluate": {"data"},
    "memory": {"config", "model", "xla", "train", "memory"},
    "publish": {"config", "model", "publish"},
    "doctor": {"config", "xla"},
    "infer": {"config", "model", "data", "xla", "train", "publish", "evaluate", "infer"},
}
BASICS = {"errors", "files", "console", "hosts", "faults"}


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


def test_jax_is_imported_by_the_tpu_compiler_modules_only():
    """jax (a second XLA beside torch_xla's) is loaded only in the subprocesses of ``memory --compile``."""
    offenders = [
        name for name, path in modules().items() if any(m.split(".")[0] in ("jax", "jaxlib") for m in imports(path))
    ]
    assert sorted(offenders) == ["lowmem_tpu.xla.pallas", "lowmem_tpu.xla.tpu_compiler"]


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


def test_basic_modules_import_nothing_of_ours_but_errors_and_hosts():
    """``hosts`` (which host of a pod slice this is) is asked by the console before it prints."""
    allowed = ("lowmem_tpu.errors", "lowmem_tpu.hosts")
    for basic in BASICS:
        ours = {m for m in imports(PACKAGE / f"{basic}.py") if m.startswith("lowmem_tpu")}
        ours -= {"lowmem_tpu"}  # "from lowmem_tpu import hosts"
        assert all(m.startswith(allowed) for m in ours), (basic, ours)


def test_no_module_is_over_the_size_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _runtime_imports(path: Path) -> set[str]:
    """Every import a module runs, at its top or deferred inside a function (not ``if TYPE_CHECKING:`` ones)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "deferred-included"])
def test_imports_have_no_cycle(deferred):
    """A deferred import must not hide a cycle either (config.schema and config.checks once did)."""
    ours = set(modules())
    graph = {
        name: {m for m in (_runtime_imports(path) if deferred else imports(path, top_level_only=True)) if m in ours}
        - {name}
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


def test_every_folder_says_what_it_owns():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.parent.name}/__init__.py needs a docstring on what it owns"


def test_only_the_hosts_module_knows_which_host_this_is():
    """Under SPMD, HF Trainer and accelerate say "process 0 of 1" on every host of a pod slice: never ask them."""
    asks = ("process_index", "is_world_process_zero", "is_local_process_zero", "world_size", "global_ordinal")
    offenders = {
        name
        for name, path in modules().items()
        if name not in ("lowmem_tpu.hosts", "lowmem_tpu.xla.runtime") and any(a in path.read_text() for a in asks)
    }
    assert offenders == set()
