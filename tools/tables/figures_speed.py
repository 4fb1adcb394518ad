"""Figures in sentences of docs/speed.md and docs/memory.md: from tune's records and from the planner."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

from lowmem_tpu.console import size
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

from .common import RESULTS, shipped_recipe


def tune_candidate_seconds(result: str) -> Callable[[], str]:
    """docs/speed.md: the median time ``lowmem-tpu tune`` took per compiled candidate in a recorded search."""

    def figure() -> str:
        tried = json.loads((RESULTS / result).read_text())["tried"]
        return f"{statistics.median(t['seconds'] for t in tried if t.get('seconds')):.0f} s"

    return figure


def _report(recipe: str, overrides: list[str] | None = None):
    loaded = shipped_recipe(recipe, overrides)
    return plan_recipe(loaded, loaded.runtime.target, require_config(loaded))


def plan_figure(recipe: str, overrides: list[str] | None, which: str, field: str) -> Callable[[], str]:
    """docs/memory.md: one figure of ``lowmem-tpu memory RECIPE [overrides]`` for the recipe's target:
    ``which`` is ``plan`` (the recipe) or ``twin``, ``field`` a Plan attribute (``persistent``, ``needed``...)."""

    def figure() -> str:
        return size(getattr(getattr(_report(recipe, overrides), which), field))

    return figure


def dropout(which: str, field: str) -> Callable[[], str]:
    """docs/memory.md: ``lowmem-tpu memory recipes/open_llama_lora.yaml lora.dropout=0.05``'s figures."""
    return plan_figure("open_llama_lora", ["lora.dropout=0.05"], which, field)
