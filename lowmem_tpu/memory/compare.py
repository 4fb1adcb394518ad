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

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.platform import on_tpu
from lowmem_tpu.memory import measure
from lowmem_tpu.memory.advise import plan_json
from lowmem_tpu.memory.plan import Plan, plan_setting
from lowmem_tpu.memory.shape import require_config, setting_of, shape_of

SEGMENTS = ("weights", "optimizer", "gradients", "step temporaries")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def _measured(recipe: Recipe, steps: int) -> dict[str, Any]:
    """One mode measured: its per-device segments, peak, and where the figures came from."""
    if on_tpu(recipe.runtime.device):
        run = measure.run_steps(recipe, steps)
        peak, state = run.peak_bytes, run.state
        extra = {"source": f"{run.device_kind} runtime: peak of xm.get_memory_info after {steps} real steps"}
        extra |= {"tokens_per_second": run.tokens_per_second, "compile_seconds": run.compile_seconds}
        extra["devices"] = run.devices
    else:
        step = measure.compile_step(recipe, recipe.runtime.num_cpu_devices)
        peak, state = step.compiler.total_bytes, step.state
        extra = {
            "source": "CPU compiler: XLA buffer assignment of one device's partition of the real step (compiled, "
            "not run): parameters + temporaries + outputs",
            "tokens_per_second": None,
            "compile_seconds": step.compile_seconds,
            "compiler": asdict(step.compiler),
            "host_peak_rss_bytes": step.host_peak_rss_bytes,
            "devices": step.devices,
        }
    temporaries = peak - state.weights - state.optimizer - state.gradients
    segments = dict(zip(SEGMENTS, (state.weights, state.optimizer, state.gradients, temporaries), strict=True))
    return {"peak": peak, "segments": segments, "state": asdict(state)} | extra


def _planned(plan: Plan) -> dict[str, Any]:
    temporaries = plan.peak - plan.weights - plan.optimizer - plan.gradients
    values = (plan.weights, plan.optimizer, plan.gradients, temporaries)
    return {"peak": plan.peak, "segments": dict(zip(SEGMENTS, values, strict=True)), "plan": plan_json(plan)}


def compare_recipe(recipe: Recipe, steps: int, out: Path) -> dict[str, Any]:
    """Plan and measure the recipe as LoRA and as full fine-tuning; write compare.json and compare.png."""
    config = require_config(recipe)
    shape = shape_of(config)
    modes: dict[str, Any] = {}
    for name, enabled in (("lora", True), ("full", False)):
        # Full fine-tuning trains the base itself: a quantized (QLoRA) recipe's twin is unquantized.
        unquantized = [] if enabled else ["model.quantize=none"]
        variant = measure.load_recipe_text(recipe, [f"lora.enabled={str(enabled).lower()}", *unquantized])
        measured = _measured(variant, steps)
        layout = "tpu" if on_tpu(variant.runtime.device) else "cpu"
        setting = setting_of(variant, measured["devices"])
        plan = plan_setting(shape, setting, layout, 0)
        modes[name] = {"planned": _planned(plan), "measured": measured, "layout": layout}
    result = {"model": recipe.model.name_or_path, "dtype": recipe.model.dtype, "modes": modes}
    result["quantize"] = recipe.model.quantize if recipe.lora.enabled else "none"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    try:
        result["chart"] = str(chart(result, out / "compare.png"))
    except ImportError:  # matplotlib is the optional "plot" extra
        result["chart"] = None
    return result


def _human(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_compare(result: dict[str, Any]) -> str:
    """Planned beside measured, per device, for both modes."""
    lora, full = result["modes"]["lora"], result["modes"]["full"]
    header = f"  {'per device':<26}{'LoRA planned':>14}{'measured':>12}{'full planned':>16}{'measured':>12}"
    quant = result.get("quantize", "none")
    base = f", LoRA on an {quant} base" if quant != "none" else ""
    lines = [f"{result['model']} ({result['dtype']}{base}), {lora['measured']['devices']} devices", header]
    for segment in (*SEGMENTS, "peak"):
        cells = []
        for mode in (lora, full):
            for side in ("planned", "measured"):
                cells.append(_human(mode[side]["peak"] if segment == "peak" else mode[side]["segments"][segment]))
        lines.append(f"  {segment:<26}{cells[0]:>14}{cells[1]:>12}{cells[2]:>16}{cells[3]:>12}")
    for mode in (lora, full):
        error = mode["planned"]["peak"] / mode["measured"]["peak"] - 1
        lines.append(f"  {mode['planned']['plan']['mode']}: planned peak {100 * error:+.1f}% off the measured one")
    for key, label in (("compile_seconds", "compile time (s)"), ("tokens_per_second", "tokens/s")):
        values = [mode["measured"].get(key) for mode in (lora, full)]
        shown = ["n/a (not run)" if v is None else f"{v:,.1f}" for v in values]
        lines.append(f"  {label:<26}LoRA {shown[0]}, full {shown[1]}")
    lines.append(f"measured: {lora['measured']['source']}")
    lines.append("planned: lowmem_tpu.memory, " + ("TPU" if lora["layout"] == "tpu" else "CPU-backend") + " layout")
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> Path:
    """Stacked bars, LoRA and full side by side, planned (hatched) beside measured, segment by segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, side) for m in ("lora", "full") for side in ("planned", "measured")]
    top = max(result["modes"][m][side]["peak"] for m, side in bars)
    unit, scale = ("GiB", 2**30) if top >= 2 * 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    positions = [0, 0.75, 2.25, 3.0]
    for x, (mode, side) in zip(positions, bars, strict=True):
        data, bottom = result["modes"][mode][side], 0.0
        for segment, color in zip(SEGMENTS, COLORS, strict=True):
            value = max(data["segments"][segment], 0) / scale
            hatch = "//" if side == "planned" else None
            label = segment if (mode, side) == ("lora", "measured") else None
            ax.bar(x, value, bottom=bottom, color=color, hatch=hatch, edgecolor="white", width=0.65, label=label)
            bottom += value
        ax.text(x, bottom, _human(data["peak"]), ha="center", va="bottom", fontsize=9)
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
