"""What ``memory --compile`` reports: the step estimated by the TPU compiler's cost model, the JSON, the text,
and the planner's figures beside the compiler's (:func:`compile_beside_plan`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.config.schema import reference_precomputed
from lowmem_tpu.console import size
from lowmem_tpu.data.fill import Fill
from lowmem_tpu.measure.tpu_compile import MARGIN, TpuCompile, compile_recipe, compile_target

# ----------------------------------------------------------------------------- the step's cost

# [length, length] matmuls per run of torch_xla's Pallas FlashAttention kernels (jax's
# ops/tpu/flash_attention.py) that declare no cost: dq runs q.k, do.v, ds.k; dkv q.k, p.do, do.v, ds.q.
# The forward kernel declares its own (q.k and p.v: 4 x batch x heads x length^2 x head).
FLASH_MATMULS = {"_flash_attention_dkv_kernel": 4, "_flash_attention_dq_kernel": 3}


def kernel_seconds(kernel: dict[str, Any], device: Any) -> tuple[float, str]:
    """One Pallas kernel's time per step from its shapes: its flops at the MXU's peak or its HBM bytes at
    HBM bandwidth, whichever is larger (a kernel carries no cycle estimate), and which one it was."""
    flops = kernel.get("flops")
    shapes = [s for s in kernel["shapes"] if len(s) == 4]
    if flops is None and kernel["name"] in FLASH_MATMULS and shapes:
        batch, heads, length, head = shapes[0]
        flops = FLASH_MATMULS[kernel["name"]] * 2.0 * batch * heads * length * length * head
    compute, memory = (flops or 0) / device.peak_flops, kernel["hbm_bytes"] / device.hbm_bandwidth
    how = "flops at the MXU's peak" if compute > memory else "HBM bytes at HBM bandwidth"
    return max(compute, memory) * kernel["runs"], how


def step_estimate(
    result: TpuCompile,
    model_flops_per_chip: float | None,
    positions_per_chip: int,
    fill: float | None,
    fill_source: str = "",
) -> dict[str, Any]:
    """The step on one chip, three ways, each a lower bound of what it costs:

    - compute: the TPU compiler's own cost model, its ``estimated_cycles`` summed over the optimized program
      with loop trip counts (measure.hlo_cost) at the chip's clock, plus each Pallas kernel from its shapes;
    - interconnect: the bytes one chip receives in the step's collectives (measure.collectives) at what the
      slowest chip of the slice can receive (``Device.ici_in_bandwidth``, the published bandwidth);
    - HBM: the bytes the program reads and writes in HBM at the chip's HBM bandwidth.

    The step is the largest (the others overlapped with it, as the compiler schedules them), the sum beside
    it the pessimistic bound (nothing overlapped). From the step: MFU (the model's flops, recomputation not
    counted) and tokens/s/chip (``positions_per_chip``, a row's every position; useful ones at ``fill``, the
    share that is not padding). No TPU run is behind any of it."""
    device = DEVICES[result.device]
    step = result.step
    if not step:
        return {"reported": False, "why": "no optimized program in this record (compile it again)"}
    if not device.clock_hz:
        return {"reported": False, "why": f"the {device.generation} TensorCore clock is not known here"}
    compiled = step["cycles"] / device.clock_hz
    kernels = [kernel_seconds(k, device) for k in step.get("kernels", [])]
    compute = compiled + sum(t for t, _ in kernels)
    received = sum(step.get("received", {}).values())
    bandwidth = device.ici_in_bandwidth
    ici = received / bandwidth if bandwidth else 0.0
    hbm = step["hbm_bytes"] / device.hbm_bandwidth
    times = {"compute": compute, "interconnect": ici, "HBM": hbm}
    seconds = max(times.values())
    out: dict[str, Any] = {
        "reported": True,
        "step_seconds": seconds,
        "bound_by": max(times, key=times.__getitem__),
        "sum_seconds": sum(times.values()),
        "compute_seconds": compute,
        "compiled_seconds": compiled,
        "kernel_seconds": compute - compiled,
        "kernels_costed_by": sorted({how for _, how in kernels}),
        "ici_seconds": ici,
        "ici_bytes_per_chip": received,
        "ici_bytes_per_second": bandwidth,
        "hbm_seconds": hbm,
        "flops_per_chip": step["flops"],
        "hbm_bytes_per_chip": step["hbm_bytes"],
        "positions_per_chip": positions_per_chip,
        "tokens_per_second_per_chip": positions_per_chip / seconds,
        "fill": fill,
        "fill_source": fill_source,
    }
    if "received" not in step and device.devices > 1:
        out["ici_unknown"] = "the record holds no collectives (compiled before they were counted): compile again"
    if fill is not None:
        out["useful_tokens_per_second_per_chip"] = fill * positions_per_chip / seconds
    if model_flops_per_chip:
        out["model_flops_per_chip"] = model_flops_per_chip
        out["mfu"] = model_flops_per_chip / seconds / device.peak_flops
    if step.get("loops_unresolved"):
        out["loops_counted_once"] = step["loops_unresolved"]
    return out


def recipe_fill(recipe: Recipe) -> Fill:
    """The fill of the recipe's data, padded and packed, when the data and tokenizer are at hand here
    (a Hub dataset without a network is not: the Fill says why)."""
    from lowmem_tpu.data.fill import measure_fill
    from lowmem_tpu.model.tokenizer import load_tokenizer

    try:
        return measure_fill(recipe.data, load_tokenizer(recipe.model))
    except Exception as err:  # a Hub dataset or tokenizer offline, a file that is not there: no figure
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return Fill(None, None, why=f"the data or tokenizer is not at hand here ({first[:160]})")


# ----------------------------------------------------------------------------- output


def compile_json(result: TpuCompile, planned_peak: int | None, cost: dict[str, Any]) -> dict[str, Any]:
    """``--json``: every figure in bytes, the verdict, and the plan's error against the compiler."""
    figures = {"needed": result.needed, "held": result.held, "free": result.free, "fits": result.fits}
    out = asdict(result) | figures | {"margin": MARGIN, "step_estimate": cost}
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
        lines.append(f"  {'needed (buffers)':<44}{g(result.needed):>11}")
        lines.append(f"  {'generated code (in HBM too)':<44}{g(result.generated_code):>11}")
        if result.line_error:
            error = round(result.line_error * result.needed)
            label = f"the line's error ({result.line_error:.1%}, extrapolated)"
            lines.append(f"  {label:<44}{g(error):>11}")
        verdict = (
            f"fits, {g(result.free)} free (at least {g(MARGIN)} kept free)"
            if result.fits
            else f"does not fit with {g(MARGIN)} kept free ({g(result.free)} free)"
        )
        lines.append(f"  {'held':<44}{g(result.held):>11} of {g(result.capacity)}: {verdict}")
        lines.append(f"  on-chip scratch (not HBM) {g(result.scratch)}")
        if result.host:
            lines.append(f"  host memory (offloaded, not HBM) {g(result.host)}")
        if result.kernels:
            lines.append(f"  Pallas kernels in the step: {result.kernels} (compiled for the TPU by libtpu)")
        if result.gathered:
            gathers = ", ".join(f"{dtype} {g(n)}" for dtype, n in sorted(result.gathered.items(), key=lambda x: -x[1]))
            lines.append(f"  all-gathered per chip (each gather once per run): {gathers}")
    if planned_peak is not None:
        error = (planned_peak - result.needed) / result.needed if result.needed else 0.0
        lines.append(f"  the planner's peak: {g(planned_peak)} ({error:+.0%} against the compiler)")
    if cost.get("reported"):
        lines += estimate_lines(cost, micro=bool(result.resident))
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


def estimate_lines(cost: dict[str, Any], micro: bool = False) -> list[str]:
    """The step estimate as the report prints it (``micro``: the program is one micro-batch's)."""
    unit = "micro-batch" if micro else "step"
    ms = {key: cost[f"{key}_seconds"] * 1e3 for key in ("step", "compute", "ici", "hbm", "sum")}
    kernels = ""
    if cost["kernel_seconds"]:
        how = ", ".join(cost["kernels_costed_by"])
        kernels = f", {cost['kernel_seconds'] * 1e3:.0f} ms of it Pallas kernels, by {how}"
    lines = [
        f"  {unit} {ms['step']:.0f} ms, bound by {cost['bound_by']} (the largest of: compute {ms['compute']:.0f} ms by "
        f"libtpu's cost model{kernels}; interconnect {ms['ici']:.0f} ms; HBM {ms['hbm']:.0f} ms), "
        f"{ms['sum']:.0f} ms if nothing overlapped"
    ]
    if cost.get("ici_bytes_per_second"):
        lines.append(
            f"  interconnect: {cost['ici_bytes_per_chip'] / 1e9:.2f} GB into each chip per {unit} at "
            f"{cost['ici_bytes_per_second'] / 1e9:.0f} GB/s (the slowest chip's links, the published bandwidth)"
        )
    if cost.get("ici_unknown"):
        lines.append(f"  interconnect not counted: {cost['ici_unknown']}")
    figures = [f"{cost['flops_per_chip'] / 1e12:.1f} TFLOP", f"HBM {cost['hbm_bytes_per_chip'] / 1e9:.0f} GB"]
    if "mfu" in cost:
        figures.append(f"MFU {cost['mfu']:.0%}")
    tokens = f"{cost['tokens_per_second_per_chip']:,.0f} tokens/s/chip"
    if "useful_tokens_per_second_per_chip" in cost:
        tokens += f" ({cost['useful_tokens_per_second_per_chip']:,.0f} useful at fill {cost['fill']:.0%}"
        tokens += f", {cost['fill_source']})" if cost.get("fill_source") else ")"
    else:
        why = f"{cost['fill_source']}: " if cost.get("fill_source") else ""
        tokens += f" (every position, padding included; {why}--fill R for useful tokens)"
    lines.append(f"  per chip per {unit}: {', '.join(figures)}; {tokens}")
    if cost.get("loops_counted_once"):
        lines.append(f"  {cost['loops_counted_once']} loops without a readable trip count, counted once")
    lines.append("  (estimates from libtpu's cost model and the published bandwidths: no TPU run is behind them)")
    return lines


# ----------------------------------------------------------------------------- beside the plan

# The TPU compiler's records of the shipped recipes, in a clone of the repository (tools/tpu_compile_recipes.py).
RECORDS = Path(__file__).resolve().parents[2] / "docs" / "tpu_compile.json"


def recorded_verdict(name: str, device: str, plan: Any) -> dict[str, Any] | None:
    """What the TPU compiler's record says of a shipped recipe on ``device`` (None without one), and which
    figure to trust beside the plan: the compiler's, the program's own buffers; the plan is arithmetic."""
    import json

    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    record = records.get(f"{name}@{device}") or {}
    if not record.get("needed") or "free" not in record:
        return None
    held, free = record["held"], record["free"]
    how = "extrapolated along the layers" if record.get("extrapolated_from") else "compiled whole"
    verdict = "fits" if record["fits"] else "does not fit"
    text = (
        f"the TPU compiler's record (docs/tpu_compile.json, {how}): {size(held)} held of {size(record['capacity'])} "
        f"(buffers, code, the line's error), {size(free)} free: {verdict} with {size(MARGIN)} kept free"
    )
    if record["fits"] != plan.fits:
        text += (
            "; trust the compiler's figure: it is the buffer assignment of the program a run executes, the plan "
            "an arithmetic model of it with a margin of its own"
        )
    return {"held": held, "free": free, "fits": record["fits"], "text": text}


def compile_beside_plan(
    recipe: Recipe,
    device_name: str,
    result: TpuCompile | None = None,
    fill: float | None = None,
    fill_source: str = "",
) -> tuple[TpuCompile, dict[str, Any], str]:
    """``memory --compile``: the compiler's figures, their JSON (the plan and cost beside them), the report.

    ``result``: figures compiled already (the recipes script), else the step is traced and compiled now.
    ``fill``: the share of row positions that are real tokens (useful tokens/s), when known; ``fill_source``
    says where it comes from (or why it is not known).
    """
    from dataclasses import replace

    from lowmem_tpu.memory.advise import next_steps, plan_recipe, together
    from lowmem_tpu.memory.plan import plan_setting
    from lowmem_tpu.memory.shape import shape_of
    from lowmem_tpu.model.architecture import flops_per_token
    from lowmem_tpu.model.build import require_config

    device = compile_target(device_name)
    config = require_config(recipe)
    report = plan_recipe(recipe, device.name, config)  # also refuses a batch the chips do not split
    result = result or compile_recipe(recipe, device)
    plan = report.plan
    method = METHODS[recipe.method]  # a preference method: two rows a pair (DPO: and the reference's pass)
    rows = recipe.train.global_batch_size // recipe.train.gradient_accumulation_steps  # one program's micro-batch
    positions = rows * method.rows_per_example * recipe.data.max_length // device.devices
    per_token = flops_per_token(
        config,
        plan.total_parameters,
        plan.trainable_parameters,
        recipe.data.max_length,
        recipe.lora.enabled,
        forward_passes=method.forward_passes(reference_precomputed(recipe)),
    )
    cost = step_estimate(result, per_token * positions, positions, fill, fill_source)
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
