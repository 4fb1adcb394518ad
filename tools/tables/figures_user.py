"""Figures in the sentences of the user guides (README.md, docs/tpu.md, docs/qlora.md, ...): each from its source,
the device catalog, the planner or a benchmark's record, as a ``fig-`` span's text."""

from __future__ import annotations

import json
from collections.abc import Callable

from lowmem_tpu.config.devices import GENERATIONS, GiB
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

from .common import RESULTS, shipped_recipe


def usable(generation: str = "v5e") -> Callable[[], str]:
    """What the TPU compiler allows a program on one chip of ``generation`` (lowmem_tpu/config/devices.py)."""

    def run() -> str:
        return f"{GENERATIONS[generation].usable_bytes / GiB:.4g} GiB"

    return run


def peak_sum(name: str) -> Callable[[], str]:
    """docs/tpu.md: a shipped recipe's planned peak per chip as the sum of its terms, in the order
    ``lowmem_tpu.memory.plan.tpu_plan`` adds them, with the backward pass's moment that sets it."""

    def run() -> str:
        from lowmem_tpu.memory import tpu_layout
        from lowmem_tpu.memory.plan import parameters, shard_numel
        from lowmem_tpu.memory.shape import shape_of

        recipe = shipped_recipe(name)
        plan = plan_recipe(recipe, recipe.runtime.target, require_config(recipe)).plan
        s, st = shape_of(require_config(recipe)), plan.setting
        trained = sum(shard_numel(p.shape, st.strategy, st.devices) for p in parameters(s, st) if p.trainable)
        t = tpu_layout.transients(s, st, trained)
        terms = [(plan.weights, "weights"), (plan.optimizer, "optimizer state"), (plan.gradients, "gradients")]
        terms.append((t.gathered, "workspace"))
        layer_phase = max(t.kept - t.freed_before_recompute + t.layer, t.kept + t.workspace)
        if t.kept + t.logits >= layer_phase + t.gradients:
            moment = "the loss's"
            terms += [(t.kept, "activations kept"), (t.logits, "logits")]
        else:
            moment = "the layer's"
            terms += [(t.kept - t.freed_before_recompute, "activations kept"), (layer_phase - t.kept, "the layer")]
            terms.append((t.gradients, "gradient copies"))
        terms += [(t.dequantized, "a quantized base's extra activations"), (plan.dropout_masks, "dropout's bits")]
        terms = [(n, what) for n, what in terms if n]
        if sum(n for n, _ in terms) != plan.peak:
            raise ValueError(f"{name}: the terms do not add up to the planned peak")
        figures = " + ".join(f"{n / GiB:.3g}" for n, _ in terms)
        names = ", ".join(what for _, what in terms)
        return f"{moment}: {figures} = {plan.peak / GiB:.3g} GiB ({names})"

    return run


def _quant_rows() -> dict[str, dict]:
    record = json.loads((RESULTS / "quant_quality.json").read_text())
    return {row["base"]: row for row in record["rows"]}


def bytes_per_parameter(base: str) -> Callable[[], str]:
    """docs/qlora.md: a base's bytes per parameter (benchmarks/results/quant_quality.json)."""

    def run() -> str:
        return f"{_quant_rows()[base]['bytes_per_parameter']:.3f}"

    return run


def quant_widest_gap() -> str:
    """docs/qlora.md: the largest loss gap to bf16 of any quantized base, held-out or after LoRA
    (benchmarks/results/quant_quality.json, nats per byte)."""
    rows = _quant_rows()
    bf16 = rows.pop("bf16")
    gaps = [abs(r[k] - bf16[k]) for r in rows.values() for k in ("code_loss", "docs_loss_after_lora")]
    return f"{max(gaps):.4f}"
