"""Tables of the TPU compiler's records (docs/tpu_compile.json) and of tune's searches (benchmarks/results/)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.config.shipped import describe_shipped
from lowmem_tpu.console import size
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

from .common import RECORD, RESULTS, ROOT, shipped_recipe, targets


def _what(recipe) -> str:
    method = "full fine-tuning" if not recipe.lora.enabled else "LoRA"
    if recipe.model.quantize not in (None, "none"):
        method = f"QLoRA ({recipe.model.quantize} base)"
    elif not recipe.lora.enabled:
        method += f", {recipe.train.optimizer}"
    model = recipe.model.name_or_path.split("/")[-1]
    tokens = f"{recipe.train.global_batch_size} x {recipe.data.max_length} tokens per step"
    if METHODS[recipe.method].preference:
        method = f"{recipe.method.upper()} ({method})"
    if METHODS[recipe.method].pairs:
        tokens = f"{recipe.train.global_batch_size} pairs x 2 x {recipe.data.max_length} tokens per step"
    split = recipe.train.gradient_accumulation_steps
    return f"{method}, {model}, {tokens}" + (f" in {split} micro-batches" if split > 1 else "")


def _compiler(records: dict, name: str, device: str) -> str:
    record = records.get(f"{name}@{device}")
    if record is None:
        return "not compiled"
    if record.get("blocked"):
        return f"not compiled here: {record['blocked']}"
    free = record.get("free")
    held = f"{size(record['held'])}, {size(free)} free" if free is not None else size(record["needed"])
    verdict = f"{held}: {'fits' if record['fits'] else '**does not fit**'}"
    if record.get("extrapolated_from"):
        verdict += " (extrapolated from {}- and {}-layer compiles)".format(*record["extrapolated_from"])
    return verdict


def _step(records: dict, name: str, device: str) -> str:
    estimate = (records.get(f"{name}@{device}") or {}).get("step_estimate") or {}
    if not estimate.get("reported"):
        return ""
    return f"{estimate['step_seconds']:.2f} s, {estimate.get('bound_by', 'compute')} ({estimate['mfu']:.0%})"


def table() -> str:
    """README.md: each shipped recipe on its target, the planner's peak beside the TPU compiler's figure."""
    records = json.loads(RECORD.read_text())
    rows = [
        "| recipe | `runtime.target` | what | planned peak | needed (+ margin) | TPU compiler: held, free | of "
        "| one micro-batch: the estimate, what bounds it (MFU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for item in describe_shipped():
        if not item.target or item.target == "cpu":
            compiled = ", ".join(f"{size(records[f'{item.name}@{d}']['needed'])} on {d}" for d in ("v5e-8", "v5e-1"))
            rows.append(f"| `{item.name}.yaml` | cpu | the demo | | | {compiled} | | |")
            continue
        recipe = load_recipe(str(item.path), ["runtime.device=tpu"])
        plan = plan_recipe(recipe, item.target, require_config(recipe)).plan
        rows.append(
            f"| `{item.name}.yaml` | {item.target} | {_what(recipe)} | {size(plan.peak)} "
            f"| {size(plan.needed)} | {_compiler(records, item.name, item.target)} | {size(plan.capacity)} "
            f"| {_step(records, item.name, item.target)} |"
        )
    return "\n".join(rows)


def _how(record: dict) -> str:
    """How the figure was made: whole, or at 2 and 4 layers (and why), with the time and host RAM it took."""
    seconds = f"{record['trace_seconds']:.0f} s + {record['compile_seconds']:.0f} s"
    if not record.get("extrapolated_from"):
        return f"whole: {seconds}, host peak {size(record['host_peak_rss_bytes'])}"
    why = (record.get("whole_blocked") or "").split(" (")[0].split(":")[0]
    low, high = record["extrapolated_from"]
    peak = size(record["host_peak_rss_bytes"])
    return f"at {low} and {high} layers, extrapolated ({why}): {seconds}, host peak {peak}"


def compiler_table() -> str:
    """docs/tpu_compiler.md: the TPU compiler's record of every shipped recipe in full."""
    records = json.loads(RECORD.read_text())
    rows = [
        "| recipe | target | held (needed + code + line's error) of usable HBM | arguments / temporaries "
        "| planner's peak (error) | the step, MFU | all-gathered (x the weights) | compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, device, path in targets():
        record = records.get(f"{name}@{device}")
        if record is None or record.get("blocked"):
            rows.append(f"| `{name}.yaml` | {device} | {_compiler(records, name, device)} | | | | | |")
            continue
        verdict = "fits" if record["fits"] else "**does not fit**"
        error = f" ({record['plan_error']:+.1%})" if record.get("plan_error") is not None else ""
        estimate = record.get("step_estimate") or {}
        cost = f"{estimate['step_seconds']:.2f} s, {estimate['mfu']:.0%}" if estimate.get("reported") else ""
        held = record.get("held", record["needed"])
        rows.append(
            f"| `{name}.yaml` | {device} | {size(held)} of {size(record['capacity'])}: {verdict} "
            f"| {size(record['arguments'])} / {size(record['temporaries'])} "
            f"| {size(record.get('planned_peak'))}{error} | {cost} | {_gathered(record, path, device)} "
            f"| {_how(record)} |"
        )
    return "\n".join(rows)


def _gathered(record: dict, path: Path, device: str) -> str:
    """What a step's all-gathers bring to a chip, against the model's weights as stored (once each)."""
    gathered = sum((record.get("gathered") or {}).values())
    if not gathered:
        return "none"
    from lowmem_tpu.memory.plan import parameters
    from lowmem_tpu.memory.shape import setting_of, shape_of

    recipe = load_recipe(str(path), ["runtime.device=tpu"])
    shape = shape_of(require_config(recipe))
    weights = sum(math.prod(t.shape) * t.itemsize for t in parameters(shape, setting_of(recipe, 1)))
    return f"{size(gathered)} ({gathered / weights:.2f}x)"


def layers_table() -> str:
    """docs/tpu_compiler.md: the recipes compiled at 2 and 4 layers, each compile and the line through them."""
    from lowmem_tpu.memory.shape import shape_of

    records = json.loads(RECORD.read_text())
    rows = [
        "| recipe | target | fewer layers: needed (arguments / temporaries) | more layers | one layer more "
        "| the line at the model's layers | host peak at fewer / more layers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, device, path in targets():
        record = records.get(f"{name}@{device}") or {}
        if not record.get("extrapolated_from") or not record.get("layers"):
            continue
        low, high = (record["layers"][str(n)] for n in record["extrapolated_from"])
        layers = shape_of(require_config(load_recipe(str(path), ["runtime.device=tpu"]))).layers
        step = (high["needed"] - low["needed"]) / (record["extrapolated_from"][1] - record["extrapolated_from"][0])

        def point(n: int, p: dict) -> str:
            return f"{n}: {size(p['needed'])} ({size(p['arguments'])} / {size(p['temporaries'])})"

        fewer, more = record["extrapolated_from"]
        rows.append(
            f"| `{name}.yaml` | {device} | {point(fewer, low)} | {point(more, high)} | {size(step)} "
            f"| {size(record['needed'])} at {layers} | "
            f"{size(low['host_peak_rss_bytes'])} / {size(high['host_peak_rss_bytes'])} |"
        )
    return "\n".join(rows)


def slopes_table() -> str:
    """docs/tpu_compiler.md: one decoder layer's cost per chip (benchmarks/results/tpu_layer_slopes.json) beside
    the planner's per-layer terms as they are now (what ``benchmarks/tpu_layer_slopes.py`` would record)."""
    from lowmem_tpu.memory.shape import setting_of, shape_of
    from lowmem_tpu.memory.tpu_layout import _gathering, dequantized, kept

    recorded = json.loads((RESULTS / "tpu_layer_slopes.json").read_text())
    rows = [
        "| name | recipe, overrides | target | tokens per chip | gathered | arguments per layer "
        "| temporaries per layer | per token | windowed outputs per token "
        "| the planner now: kept + quantized, per token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gathered = {"weights gathered": "weights", "activations gathered": "activations", "one chip": "(one chip)"}
    for name, row in recorded.items():
        recipe = load_recipe(str(ROOT / row["recipe"]), [*row["overrides"], "runtime.device=tpu"])
        shape = shape_of(require_config(recipe))
        setting = setting_of(recipe, DEVICES[row["device"]].devices)
        hidden = setting.tokens * shape.hidden * 2
        kept_now = kept(shape, setting, setting.checkpointing) / shape.layers / hidden
        quantized_now = dequantized(shape, setting) / shape.layers / hidden
        label = f"`{Path(row['recipe']).name}`" + "".join(f" `{o}`" for o in row["overrides"])
        per = row["per_layer_bytes"]
        rows.append(
            f"| {name} | {label} | {row['device']} | {row['tokens_per_chip']} | "
            f"{gathered[_gathering(shape, setting)]} | {size(per['arguments'])} | {size(per['temporaries'])} | "
            f"{row['temporaries_per_token']:.2f} | {row['windowed_outputs_per_token']:.2f} | "
            f"{kept_now:.1f} + {quantized_now:.1f} |"
        )
    return "\n".join(rows)


def speed_table() -> str:
    """docs/speed.md: every shipped recipe's step on its TPU by libtpu's cost model (docs/tpu_compile.json)."""
    records = json.loads(RECORD.read_text())
    rows = [
        "| recipe | target | HBM held per chip (free) | micro-batches per step | one micro-batch: compute "
        "| interconnect | HBM | the step (bound by) | if nothing overlapped | MFU | tokens/s/chip | compiled in |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, device, path in targets():
        record = records.get(f"{name}@{device}") or {}
        estimate = record.get("step_estimate") or {}
        if not estimate.get("reported"):
            why = estimate.get("why") or record.get("blocked") or "not compiled"
            rows.append(f"| `{name}` | {device} | {size(record.get('needed'))} | | {why} | | | | | | | |")
            continue
        micro = load_recipe(str(path), ["runtime.device=tpu"]).train.gradient_accumulation_steps
        kernels = f" (+{estimate['kernel_seconds'] * 1e3:.0f} ms kernels)" if estimate["kernel_seconds"] else ""
        ms = {k: f"{estimate.get(f'{k}_seconds', 0) * 1e3:.0f} ms" for k in ("step", "ici", "hbm", "sum")}
        held = f"{size(record.get('held', record['needed']))} ({size(record.get('free'))})"
        rows.append(
            f"| `{name}` | {device} | {held} | {micro} "
            f"| {estimate['compiled_seconds'] * 1e3:.0f} ms{kernels} | {ms['ici']} | {ms['hbm']} "
            f"| {ms['step']} ({estimate.get('bound_by', 'compute')}) | {ms['sum']} "
            f"| {estimate['mfu']:.0%} | {estimate['tokens_per_second_per_chip']:,.0f} | {_how(record)} |"
        )
    return "\n".join(rows)


# NF4's byte layout, before and after (docs/speed_calibration.md): a tune search compiled on bitsandbytes' layout
# (gathered packed across chips), at the settings the recipe ships, beside the recipe's record.
NF4_LAYOUT = {  # recipe -> the search on bitsandbytes' layout
    "llama3_8b_qlora_v5e1": "tune_llama3_8b_qlora_v5e1_rows.json",
    "llama2_70b_qlora_v5e8": "tune_llama2_70b_qlora_v5e8_bnb_layout.json",
}


def nf4_layout_table() -> str:
    """docs/speed_calibration.md: a QLoRA step with bitsandbytes' byte layout (a tune search's compile) and with
    the TPU's."""
    records = json.loads(RECORD.read_text())
    rows = [
        "| recipe | target | rows per chip x micro-batches | bitsandbytes' layout: step, MFU, tokens/s/chip "
        "| the TPU layout: step, MFU, tokens/s/chip |",
        "|---|---|---|---|---|",
    ]
    for name, result in NF4_LAYOUT.items():
        recipe = shipped_recipe(name)
        device = DEVICES[recipe.runtime.target]
        shipped = (
            recipe.train.global_batch_size // recipe.train.gradient_accumulation_steps // device.devices,
            recipe.train.gradient_accumulation_steps,
            recipe.sharding.activation_checkpointing,
            recipe.model.attn_implementation,
        )
        tried = json.loads((RESULTS / result).read_text())["tried"]
        knobs = ("rows", "accumulation", "checkpointing", "attention")
        before = next(t["estimate"] for t in tried if tuple(t["settings"][k] for k in knobs) == shipped)
        after = records[f"{name}@{device.name}"]["step_estimate"]

        def figures(e: dict) -> str:
            return f"{e['step_seconds'] * 1e3:,.0f} ms, {e['mfu']:.0%}, {e['tokens_per_second_per_chip']:,.0f}"

        rows.append(
            f"| `{name}` | {device.name} | {shipped[0]} x {shipped[1]} | {figures(before)} | {figures(after)} |"
        )
    return "\n".join(rows)


def tune_table(result: str) -> Callable[[], str]:
    """docs/speed_calibration.md: every candidate ``lowmem-tpu tune`` compiled (its JSON, in benchmarks/results/)."""

    def output() -> str:
        record = json.loads((RESULTS / result).read_text())
        unit = record["tried"][0]["settings"].get("unit", "rows")
        pairs = "; a pair is its chosen and its rejected row" if unit == "pairs" else ""
        rows = [
            f"`lowmem-tpu tune` for {record['target']}, per chip (tokens/s: every position of a row{pairs}):",
            "",
            f"| weights | {unit} per chip x micro-batches | checkpointing | attention | packed "
            "| HBM held (TPU compiler) | (micro-)step | MFU | tokens/s/chip |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in record["tried"]:
            c, e = t["settings"], t["estimate"]
            ckpt = {True: "every layer", False: "none"}.get(c["checkpointing"], c["checkpointing"])
            packed = "yes" if c["packing"] else "no"
            head = f"| {c.get('placement', 'fsdp')} | {c['rows']} x {c['accumulation']} | {ckpt} | {c['attention']} "
            head += f"| {packed} "
            if not e.get("reported"):
                rows.append(head + f"| {t['verdict']} | | | |")
                continue
            fits = "" if t["fits"] else " (does not fit)"
            bound = f" ({e['bound_by']})" if e.get("bound_by", "compute") != "compute" else ""
            rows.append(
                head + f"| {size(t.get('held') or t['needed'])}{fits} | {e['step_seconds'] * 1e3:.0f} ms{bound} "
                f"| {e['mfu']:.0%} "
                f"| {e['tokens_per_second_per_chip']:,.0f} |"
            )
        return "\n".join(rows)

    return output


def compile_output(name: str, device: str) -> Callable[[], str]:
    """``lowmem-tpu memory RECIPE --compile``'s report, printed from the recipe's record (no compile)."""

    def output() -> str:
        from dataclasses import fields

        from lowmem_tpu.measure.buffers import OutOfMemory
        from lowmem_tpu.measure.tpu_compile import TpuCompile
        from lowmem_tpu.measure.tpu_report import compile_beside_plan

        record = json.loads(RECORD.read_text())[f"{name}@{device}"]
        known = {f.name for f in fields(TpuCompile)}
        values = {k: v for k, v in record.items() if k in known}
        values["refused"] = OutOfMemory(**values["refused"]) if values.get("refused") else None
        values["extrapolated_from"] = tuple(values.get("extrapolated_from") or ())
        _, _, text = compile_beside_plan(shipped_recipe(name), device, TpuCompile(**values))
        return f"```\n$ lowmem-tpu memory recipes/{name}.yaml --compile\n{text}\n```"

    return output
