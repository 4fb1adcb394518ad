"""What ``memory --compile`` reports: the TPU compiler's cost of the step as bounds, the JSON, the text,
and the planner's figures beside the compiler's (:func:`compile_beside_plan`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.console import size
from lowmem_tpu.measure.tpu_compile import TpuCompile, compile_recipe, compile_target

# ----------------------------------------------------------------------------- the step's cost


def cost_bounds(result: TpuCompile, model_flops_per_chip: float | None, scanned: bool = False) -> dict[str, Any]:
    """The compiler's cost of one step, as bounds for the target: time >= max(flops / peak, bytes / bandwidth).

    ``model_flops_per_chip``: the model's FLOPs for one step on one chip (6N per token plus attention,
    recomputation not counted), for an upper bound on MFU. Both are the compiler's estimate for the
    program it compiled, not a measurement. ``scanned``: the layers run as one loop, whose body XLA's
    cost analysis counts once (the 3B LoRA step scanned: 3.7 TFLOP per chip against 65 unrolled), so
    no bound is drawn from it.
    """
    if scanned:
        why = "the compiler's cost counts the scanned layer once (sharding.scan_layers): no bound from it"
        return {"reported": False, "why": why}
    device = DEVICES[result.device]
    flops, accessed = result.cost.get("flops"), result.cost.get("bytes accessed")
    if not flops or not device.peak_flops or not device.hbm_bandwidth:
        return {"reported": False, "why": "the compile-only client reported no flops for this program"}
    compute, memory = flops / device.peak_flops, (accessed or 0) / device.hbm_bandwidth
    bound = max(compute, memory)
    out: dict[str, Any] = {
        "reported": True,
        "flops_per_chip": flops,
        "bytes_accessed_per_chip": accessed,
        "compute_seconds": compute,
        "memory_seconds": memory,
        "step_seconds_at_least": bound,
        "bound_by": "compute" if compute >= memory else "HBM bandwidth",
    }
    if model_flops_per_chip:
        out["mfu_at_most"] = model_flops_per_chip / bound / device.peak_flops
    return out


# ----------------------------------------------------------------------------- output


def compile_json(result: TpuCompile, planned_peak: int | None, cost: dict[str, Any]) -> dict[str, Any]:
    """``--json``: every figure in bytes, the verdict, and the plan's error against the compiler."""
    out = asdict(result) | {"needed": result.needed, "fits": result.fits, "cost_bounds": cost}
    out["source"] = "the TPU compiler (libtpu compile-only) on the step traced on the CPU backend: not a run"
    if result.extrapolated_from:
        low, high = result.extrapolated_from
        out["source"] += f"; extrapolated along the layers from compiles at {low} and {high} layers"
    if planned_peak is not None and result.error is None:
        out["planned_peak"] = planned_peak
        out["plan_error"] = (planned_peak - result.needed) / result.needed if result.needed else None
    return out


def format_compile(result: TpuCompile, planned_peak: int | None, cost: dict[str, Any], advice: str | None) -> str:
    """The human report: per chip, the compiler's figures, the verdict, the plan beside it."""
    g = size
    target = f"{result.device} ({result.topology}, {result.kind})"
    lines = [f"the TPU compiler (libtpu {result.libtpu}) for {target}, per chip:"]
    if result.error:
        return "\n".join([*lines, f"  the compiler failed: {result.error[:600]}"])
    if result.extrapolated_from:
        low, high = result.extrapolated_from
        lines.append(
            f"  extrapolated: the whole step was too big to compile on this machine; the compiles at {low} and "
            f"{high} layers, extended along the line through them to the model's layers"
        )
    if result.resident:
        lines.append(
            "  gradient accumulation: this is the first micro-batch's program (forward and backward); the "
            "optimizer's program after the last one is not compiled"
        )
    if result.refused:
        asked = f"{g(result.needed)} of {g(result.refused.capacity_bytes)}"
        lines.append(f"  does not fit: the TPU compiler asks for {asked} {result.refused.memory_space}")
        lines.append("  (arguments and temporaries: the compiler's refusal does not count outputs)")
    else:
        rows = [
            ("arguments", result.arguments),
            ("outputs", result.outputs),
            ("aliased (donated inputs reused by outputs)", -result.aliased),
            ("temporaries (HBM)", result.temporaries),
        ]
        if result.resident:
            rows.append(("optimizer state kept beside it", result.resident))
        if result.idle:
            rows.append(("weights the step never reads", result.idle))
        lines += [f"  {label:<44}{g(value):>11}" for label, value in rows]
        room = result.capacity - result.needed
        verdict = f"fits, {g(room)} free" if room >= 0 else f"does not fit, {g(-room)} short"
        lines.append(f"  {'needed':<44}{g(result.needed):>11} of {g(result.capacity)}: {verdict}")
        lines.append(f"  on-chip scratch (not HBM) {g(result.scratch)}; generated code {g(result.generated_code)}")
        if result.host:
            lines.append(f"  host memory (offloaded, not HBM) {g(result.host)}")
        if result.kernels:
            lines.append(f"  Pallas kernels in the step: {result.kernels} (compiled for the TPU by libtpu)")
        if result.gathered:
            gathers = ", ".join(f"{dtype} {g(n)}" for dtype, n in sorted(result.gathered.items(), key=lambda x: -x[1]))
            lines.append(f"  all-gathered (each instruction once): {gathers}")
    if planned_peak is not None:
        error = (planned_peak - result.needed) / result.needed if result.needed else 0.0
        lines.append(f"  the planner's peak: {g(planned_peak)} ({error:+.0%} against the compiler)")
    if cost.get("reported"):
        line = f"  step at least {cost['step_seconds_at_least'] * 1e3:.1f} ms ({cost['bound_by']})"
        if "mfu_at_most" in cost:
            line += f", MFU at most {cost['mfu_at_most']:.0%}"
        lines.append(line + ": the compiler's cost estimate, not a measurement")
    elif cost.get("why") and result.refused is None:
        lines.append(f"  step time: {cost['why']}")
    lines.append(
        f"  traced in {result.trace_seconds:.0f} s, compiled in {result.compile_seconds:.0f} s; "
        f"host peak {g(result.host_peak_rss_bytes)}; {result.placeholders} placeholders, {result.donated} donated"
    )
    if advice:
        lines.append(f"  next: {advice}")
    lines.append("  (the TPU compiler's verdict on the program traced on the CPU backend, not a run on a TPU)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- beside the plan


def compile_beside_plan(
    recipe: Recipe, device_name: str, result: TpuCompile | None = None
) -> tuple[TpuCompile, dict[str, Any], str]:
    """``memory --compile``: the compiler's figures, their JSON (the plan and cost beside them), the report.

    ``result``: figures compiled already (the recipes script), else the step is traced and compiled now.
    """
    from dataclasses import replace

    from lowmem_tpu.memory.advise import next_steps, plan_recipe, together
    from lowmem_tpu.memory.plan import plan_setting
    from lowmem_tpu.memory.shape import shape_of
    from lowmem_tpu.model.architecture import flops_per_token
    from lowmem_tpu.model.loading import require_config

    device = compile_target(device_name)
    config = require_config(recipe)
    report = plan_recipe(recipe, device.name, config)  # also refuses a batch the chips do not split
    result = result or compile_recipe(recipe, device)
    plan = report.plan
    tokens = recipe.train.global_batch_size * recipe.data.max_length
    per_token = flops_per_token(
        config, plan.total_parameters, plan.trainable_parameters, recipe.data.max_length, recipe.lora.enabled
    )
    cost = cost_bounds(result, per_token * tokens / device.devices, recipe.sharding.scan_layers)
    advice = None
    if not result.fits and result.error is None and result.needed:
        # The planner, told the compiler's verdict: its capacity scaled by how far apart they are.
        shape = shape_of(config)
        scaled = int(plan.capacity * plan.peak / result.needed)
        steps = next_steps(shape, plan_setting(shape, replace(plan.setting), plan.layout, scaled))
        if steps and steps[-1].plan.fits:  # the whole chain: one step may not be enough (full FT on one chip)
            advice = together(steps) + " (the planner's steps until it fits, then --compile again)"
        else:
            advice = "a larger TPU or a smaller model (nothing in the recipe makes it fit, per the planner)"
    out = compile_json(result, plan.peak, cost) | ({"next_step": advice} if advice else {})
    return result, out, format_compile(result, plan.peak, cost, advice)
