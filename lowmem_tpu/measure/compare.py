"""``lowmem-tpu compare``: LoRA and full fine-tuning of one recipe, planned beside measured, per device.

On a TPU each mode runs N real steps and the runtime's peak is read; on the CPU backend
each mode's real step is compiled and the compiler's figures for one device are read.
Either way the persistent state (weights, gradients, optimizer) is read from the sharded
tensors. Writes ``compare.json`` and ``compare.png`` and says which figures came from where.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, with_overrides
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.console import size
from lowmem_tpu.machine import on_tpu
from lowmem_tpu.measure import local
from lowmem_tpu.memory.advise import plan_json
from lowmem_tpu.memory.plan import Plan, plan_setting
from lowmem_tpu.memory.shape import setting_of, shape_of
from lowmem_tpu.model.build import require_config

SEGMENTS = ("weights", "optimizer", "gradients", "step temporaries")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def _measured(recipe: Recipe, steps: int, run: bool = True) -> dict[str, Any]:
    """One mode measured: its per-device segments, peak, and where the figures came from.

    On a TPU the TPU compiler's figure for the step comes first (a step it refuses is the result
    "does not fit"), then ``steps`` real steps give the runtime's sampled HBM peak; on the CPU
    backend the CPU compiler's figure is all there is. ``peak`` is None when nothing was measured.
    """
    tpu = on_tpu(recipe.runtime.device)
    platform = "TPU" if tpu else "CPU"
    step = local.compile_step(recipe, recipe.runtime.num_cpu_devices, platform=platform)
    compiler = step.compiler.total_bytes if step.compiler else None
    out: dict[str, Any] = {
        "compiler_peak": compiler,
        "compiler": asdict(step.compiler) if step.compiler else None,
        "compile_seconds": step.compile_seconds,
        "devices": step.devices,
        "tokens_per_second": None,
        "runtime_peak": None,
        "fits": step.out_of_memory is None,
    }
    if step.out_of_memory is not None:
        out["does_not_fit"] = asdict(step.out_of_memory) | {"text": step.out_of_memory.describe()}
    state, peak = step.state, compiler
    source = (
        f"{platform} compiler: XLA buffer assignment of one device's partition of the real step (compiled, not run)"
    )
    if step.missing:
        source = f"{platform} compiler: {step.missing}"
    if tpu and run and step.out_of_memory is None:
        run = local.run_steps(recipe, steps)
        out |= {"tokens_per_second": run.tokens_per_second, "runtime_peak": run.peak_bytes, "kind": run.device_kind}
        out |= {"per_device": run.per_device, "runtime_error": run.memory_error}
        state, peak = run.state, run.peak_bytes or compiler
        if run.out_of_memory is not None:
            out["fits"], out["does_not_fit"] = False, asdict(run.out_of_memory) | {"text": run.out_of_memory.describe()}
        if run.peak_bytes:
            source = f"{run.device_kind} runtime: highest HBM in use (libtpu runtime metrics) over {steps} real steps"
    if not tpu:
        out["host_peak_rss_bytes"] = step.host_peak_rss_bytes
    limits = [out.get("does_not_fit", {}).get("capacity_bytes")] + [d["limit"] for d in out.get("per_device") or []]
    out["capacity"] = min((x for x in limits if x), default=0)
    segments = None
    if peak:
        temporaries = peak - state.weights - state.optimizer - state.gradients
        values = (state.weights, state.optimizer, state.gradients, temporaries)
        segments = dict(zip(SEGMENTS, values, strict=True))
    return out | {"peak": peak, "segments": segments, "state": asdict(state), "source": source}


def measure_beside_plan(recipe: Recipe) -> dict[str, Any]:
    """``lowmem-tpu memory --compile --target cpu``: the compiler's per-device peak of the recipe's real step
    on the devices here (the CPU compiler on ``runtime.num_cpu_devices`` devices), beside the plan for the
    same devices and layout, and the planner's error against it."""
    from lowmem_tpu.xla.runtime import refuse_on_a_slice

    refuse_on_a_slice("lowmem-tpu memory --compile --target cpu", recipe.runtime.device)
    measured = _measured(recipe, steps=0, run=False)
    layout = "tpu" if on_tpu(recipe.runtime.device) else "cpu"
    setting = setting_of(recipe, measured["devices"])
    plan = plan_setting(shape_of(require_config(recipe)), setting, layout, measured["capacity"])
    peak = measured["peak"]
    return {
        "platform": "TPU" if layout == "tpu" else "CPU",
        "devices": measured["devices"],
        "layout": layout,
        "measured_peak_bytes": peak,
        "planned_peak_bytes": plan.peak,
        "planner_error": plan.peak / peak - 1 if peak else None,
        "fits": measured["fits"],
        "source": measured["source"],
        "compile_seconds": measured["compile_seconds"],
        "measured": measured,
        "step": "the real step",
    }


def format_measurement(m: dict[str, Any]) -> str:
    """The lines ``lowmem-tpu memory --compile --target cpu`` adds to the plan."""
    where = f"{m['platform']} compiler, {m['devices']} device{'s' if m['devices'] > 1 else ''}"
    if m["measured_peak_bytes"] is None:
        why = m["measured"].get("does_not_fit", {}).get("text") or m["source"]
        return f"measured ({where}): no figure: {why}"
    error = f"{100 * m['planner_error']:+.1f}%"
    return (
        f"measured ({where}, {m.get('step', 'the real step')} compiled in {m['compile_seconds']} s): "
        f"{size(m['measured_peak_bytes'])} per device; planned for the same ({m['layout']} layout): "
        f"{size(m['planned_peak_bytes'])} ({error})"
    )


def _planned(plan: Plan) -> dict[str, Any]:
    temporaries = plan.peak - plan.weights - plan.optimizer - plan.gradients
    values = (plan.weights, plan.optimizer, plan.gradients, temporaries)
    return {"peak": plan.peak, "segments": dict(zip(SEGMENTS, values, strict=True)), "plan": plan_json(plan)}


def compare_recipe(recipe: Recipe, steps: int, out: Path) -> dict[str, Any]:
    """Plan and measure the recipe as LoRA and as full fine-tuning; write compare.json and compare.png."""
    from lowmem_tpu.xla.runtime import refuse_on_a_slice

    refuse_on_a_slice("lowmem-tpu compare", recipe.runtime.device)
    config = require_config(recipe)
    shape = shape_of(config)
    target = DEVICES.get(recipe.runtime.target or "")
    modes: dict[str, Any] = {}
    for name, enabled in (("lora", True), ("full", False)):
        # Full fine-tuning trains the base itself: a quantized (QLoRA) recipe's twin is unquantized.
        unquantized = [] if enabled else ["model.quantize=none"]
        # DPO: each mode's own reference (LoRA's run in every step, full fine-tuning's computed once)
        reference = ["preference.precompute_ref_log_probs=null"] if METHODS[recipe.method].reference else []
        variant = with_overrides(recipe, [f"lora.enabled={str(enabled).lower()}", *unquantized, *reference])
        measured = _measured(variant, steps)
        layout = "tpu" if on_tpu(variant.runtime.device) else "cpu"
        setting = setting_of(variant, measured["devices"])
        plan = plan_setting(shape, setting, layout, measured.get("capacity", 0))
        modes[name] = {"planned": _planned(plan), "measured": measured, "layout": layout}
        if target is not None and layout == "cpu":  # the same mode planned on the TPU the recipe is for
            on_target = plan_setting(shape, setting_of(variant, target.devices), "tpu", target.hbm_bytes)
            modes[name]["planned_on_target"] = _planned(on_target) | {"device": target.name}
    result = {"model": recipe.model.name_or_path, "dtype": recipe.model.dtype, "modes": modes}
    result["quantize"] = recipe.model.quantize if recipe.lora.enabled else "none"
    result["method"] = recipe.method
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    try:
        result["chart"] = str(chart(result, out / "compare.png"))
    except ImportError:  # matplotlib is the optional "plot" extra
        result["chart"] = None
    return result


def _cell(mode: dict[str, Any], side: str, segment: str) -> str:
    data = mode[side]
    if segment == "peak":
        return size(data["peak"]) if data["peak"] or side == "planned" else "no fit" if not data["fits"] else "n/a"
    return size(data["segments"][segment]) if data["segments"] else "n/a"


def format_compare(result: dict[str, Any]) -> str:
    """Planned beside measured, per device, for both modes; a mode that does not fit says so."""
    lora, full = result["modes"]["lora"], result["modes"]["full"]
    header = f"  {'per device':<26}{'LoRA planned':>14}{'measured':>12}{'full planned':>16}{'measured':>12}"
    quant = result.get("quantize", "none")
    base = f", LoRA on an {quant} base" if quant != "none" else ""
    lines = [f"{result['model']} ({result['dtype']}{base}), {lora['measured']['devices']} devices", header]
    for segment in (*SEGMENTS, "peak"):
        cells = [_cell(mode, side, segment) for mode in (lora, full) for side in ("planned", "measured")]
        lines.append(f"  {segment:<26}{cells[0]:>14}{cells[1]:>12}{cells[2]:>16}{cells[3]:>12}")
    for name, mode in (("LoRA", lora), ("full fine-tuning", full)):
        measured = mode["measured"]
        if not measured["fits"]:
            lines.append(f"  {name}: {measured['does_not_fit']['text']}")
        elif measured["peak"]:
            error = mode["planned"]["peak"] / measured["peak"] - 1
            lines.append(f"  {name}: planned peak {100 * error:+.1f}% off the measured one")
        else:
            lines.append(f"  {name}: not measured ({measured['source']})")
        if measured.get("runtime_peak") and measured.get("compiler_peak"):
            compiler, runtime = size(measured["compiler_peak"]), size(measured["runtime_peak"])
            lines.append(f"  {name}: TPU compiler {compiler} per device, runtime peak {runtime}")
        if "planned_on_target" in mode:
            target = mode["planned_on_target"]
            verdict = "fits" if target["plan"]["fits"] else "does not fit"
            lines.append(f"  {name} on {target['device']} (runtime.target): planned {size(target['peak'])}, {verdict}")
    for key, label in (("compile_seconds", "compile time (s)"), ("tokens_per_second", "tokens/s")):
        values = [mode["measured"].get(key) for mode in (lora, full)]
        shown = ["n/a (not run)" if v is None else f"{v:,.1f}" for v in values]
        lines.append(f"  {label:<26}LoRA {shown[0]}, full {shown[1]}")
    if result.get("method") == "dpo":
        lines.append(
            "  DPO: LoRA's reference is the base (adapters off), run in every step; full fine-tuning's reference "
            "log-probabilities are computed once before training (no copy of the model); each step compiled as "
            "one program"
        )
    lines.append(f"measured: {lora['measured']['source']}")
    lines.append("planned: lowmem_tpu.memory, " + ("TPU" if lora["layout"] == "tpu" else "CPU-backend") + " layout")
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> Path:
    """Stacked bars, LoRA and full side by side, planned (hatched) beside measured, segment by segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, side) for m in ("lora", "full") for side in ("planned", "measured")]
    top = max(result["modes"][m][side]["peak"] or 0 for m, side in bars)
    unit, scale = ("GiB", 2**30) if top >= 2 * 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    positions = [0, 0.75, 2.25, 3.0]
    for x, (mode, side) in zip(positions, bars, strict=True):
        data, bottom = result["modes"][mode][side], 0.0
        if not data["segments"]:
            label = "does not fit" if not data.get("fits", True) else "not measured"
            ax.text(x, 0, label, ha="center", va="bottom", fontsize=9, rotation=90)
            continue
        for segment, color in zip(SEGMENTS, COLORS, strict=True):
            value = max(data["segments"][segment], 0) / scale
            hatch = "//" if side == "planned" else None
            label = segment if (mode, side) == ("lora", "measured") else None
            ax.bar(x, value, bottom=bottom, color=color, hatch=hatch, edgecolor="white", width=0.65, label=label)
            bottom += value
        ax.text(x, bottom, size(data["peak"]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(positions, [f"{'LoRA' if m == 'lora' else 'full'}\n{side}" for m, side in bars])
    ax.set_ylabel(f"{unit} per device")
    ax.set_ylim(0, top / scale * 1.12)
    tpu = result["modes"]["lora"]["layout"] == "tpu"
    source = "the TPU runtime's peak" if tpu else "the CPU compiler (the step compiled, not run)"
    ax.set_title(f"{result['model']}: LoRA vs full fine-tuning, per device\nmeasured: {source}; hatched: planned")
    ax.title.set_fontsize(10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
