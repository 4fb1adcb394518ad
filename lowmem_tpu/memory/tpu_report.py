"""What ``memory --compile`` reports: the TPU compiler's cost of the step as bounds, the JSON, the text."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.console import size

if TYPE_CHECKING:  # the figures' type only: tpu_compile imports this module to report
    from lowmem_tpu.memory.tpu_compile import TpuCompile

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
