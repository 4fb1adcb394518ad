"""What every table module shares: where the sources lie, and the shipped recipes on their targets."""

from __future__ import annotations

from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.shipped import describe_shipped

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
COMPILER_DOC = DOCS / "tpu_compiler.md"
RECORD = DOCS / "tpu_compile.json"
RESULTS = ROOT / "benchmarks" / "results"


def shipped_recipe(name: str, overrides: list[str] | None = None):
    """A shipped recipe as the TPU runs it."""
    return load_recipe(str(ROOT / "recipes" / f"{name}.yaml"), [*(overrides or []), "runtime.device=tpu"])


def targets() -> list[tuple[str, str, Path]]:
    """(name, device, path) of every shipped recipe on its target; the tiny demo on v5e-8 and v5e-1."""
    out = []
    for item in describe_shipped():
        for device in [item.target] if item.target and item.target != "cpu" else ["v5e-8", "v5e-1"]:
            out.append((item.name, device, item.path))
    return out
