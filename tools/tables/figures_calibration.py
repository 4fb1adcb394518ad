"""Figures of the calibration record (docs/memory_calibration.md) and the TPU compiler's guide
(docs/tpu_compiler.md): the planner's TPU-layout terms, its error against every compiled shipped recipe
(docs/tpu_compile.json), and the planner's own figures the prose names (arithmetic, instant)."""

from __future__ import annotations

import json
from collections.abc import Callable

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES, GENERATIONS
from lowmem_tpu.console import size
from lowmem_tpu.memory import tpu_layout
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.memory.cpu_layout import attention_scores, checkpointed_layers
from lowmem_tpu.memory.plan import Plan
from lowmem_tpu.memory.shape import setting_of, shape_of
from lowmem_tpu.model.build import require_config

from .common import RECORD, RESULTS, ROOT

# The settings the CPU compiler's Open Llama 3B figures were read at (docs/memory_calibration.md): every layer
# recomputed, eager attention, one micro-batch, unpacked rows.
UNTUNED = [
    "model.attn_implementation=eager",
    "sharding.activation_checkpointing=true",
    "train.gradient_accumulation_steps=1",
    "data.packing=false",
]
UNTUNED_ADAFACTOR = [*UNTUNED, "train.master_weights=false"]  # full fine-tuning with Adafactor alone
# 3B full fine-tuning in one micro-batch on one chip: what the TPU compiler refuses (docs/tpu_compiler.md).
FULL_ON_ONE_CHIP = [
    "sharding.activation_checkpointing=true",
    "train.gradient_accumulation_steps=1",
    "model.attn_implementation=eager",
    "data.packing=false",
]


def _recipe(name: str, overrides: list[str], target: str):
    device = "cpu" if target == "cpu" else "tpu"
    return load_recipe(str(ROOT / "recipes" / f"{name}.yaml"), [*overrides, f"runtime.device={device}"])


def _plan(name: str, overrides: list[str], target: str) -> Plan:
    recipe = _recipe(name, overrides, target)
    return plan_recipe(recipe, target, require_config(recipe)).plan


def planned(name: str, overrides: list[str], target: str, field: str = "peak") -> Callable[[], str]:
    """``lowmem-tpu memory recipes/NAME.yaml OVERRIDES --target TARGET``'s figure: the plan's ``field``."""
    return lambda: size(getattr(_plan(name, overrides, target), field))


def persistent(name: str, overrides: list[str]) -> Callable[[], str]:
    """The persistent state per device the CPU layout plans (8 CPU devices), to the byte."""

    def figure() -> str:
        p = _plan(name, [*overrides, "runtime.num_cpu_devices=8"], "cpu")
        return f"{p.weights:,} B of weights, {p.gradients:,} B of gradients, {p.optimizer:,} B of optimizer state"

    return figure


def parameters(name: str) -> Callable[[], str]:
    """The model's parameter count, as the planner counts it (billions)."""
    return lambda: f"{_plan(name, [], 'v5e-8').total_parameters / 1e9:.2f} B"


def usable_hbm(generation: str = "v5e") -> Callable[[], str]:
    """What the TPU compiler allows a program on one chip of the generation (lowmem_tpu/config/devices.py)."""
    return lambda: size(GENERATIONS[generation].usable_bytes)


def clock(generation: str = "v5e") -> Callable[[], str]:
    """The TensorCore clock the cost model's cycles are divided by (lowmem_tpu/config/devices.py)."""
    return lambda: f"{GENERATIONS[generation].clock_hz / 1e9:g} GHz"


def one_device_attention() -> str:
    """The CPU layout's term for one device with checkpointing: every checkpointed layer's q, k, v and scores,
    ``n_ckpt*(3*t*H*e + b*h*L^2*4)``, for the Open Llama 3B LoRA recipe on one chip at the untuned settings."""
    recipe = _recipe("open_llama_lora_v5e1", UNTUNED, "cpu")
    shape, setting = shape_of(require_config(recipe)), setting_of(recipe, 1)
    e = 2 if setting.dtype == "bfloat16" else 4
    n = checkpointed_layers(shape, setting) * (3 * setting.tokens * shape.hidden * e + attention_scores(shape, setting))
    return f"{n:,} B ({size(n)})"


def grid_points() -> str:
    """How many points benchmarks/results/tpu_planner_grid.json holds."""
    return str(len(json.loads((RESULTS / "tpu_planner_grid.json").read_text())))


def _value(value) -> str:
    if isinstance(value, dict):
        nested = any(isinstance(v, dict) for v in value.values())
        return "; ".join(f"{k} ({_value(v)})" if nested else f"{k} {_value(v)}" for k, v in value.items())
    return f"{value:g}"


# The planner's TPU-layout terms (lowmem_tpu/memory/tpu_layout.py): constant -> (what it counts, read off).
TERMS = {
    "KEPT_PER_LAYER": (
        "hidden-sized tensors per token a recomputed (checkpointed) layer keeps, by what FSDP gathers",
        "2- and 4-layer compiles: Open Llama 3B's LoRA step, steady (8 chips: not in the record, whose `b3b` "
        "is the first-step form; one chip: `b3b1`), Llama 2 70B's width in bf16 (`b70b`)",
    ),
    "RECOMPUTED_HIDDEN": ("the layer being recomputed: hidden-sized tensors per token", "buffers live at the peak"),
    "RECOMPUTED_INTERMEDIATE": ("the same, intermediate-sized", "buffers live at the peak"),
    "MLP_GRADIENTS_FP32": ("fp32 `[tokens, intermediate]` MLP gradients in the layer in hand", "8 chips and 1"),
    "KEPT_HIDDEN": ("a layer not recomputed: hidden-sized tensors per token", "the `none-*` slopes"),
    "KEPT_INTERMEDIATE": ("the same, intermediate-sized", "the `none-*` slopes"),
    "SEVERAL_ROWS_KEPT_HIDDEN": ("hidden-sized more where a micro-batch has several rows per chip", "`none-*`"),
    "FLASH_KEPT": ("flash: its query, keys, values and output at the head padded to 128 lanes", "`none-flash-*`"),
    "EAGER_PROBABILITIES_KEPT": (
        "eager: the share of its bf16 probabilities a layer not recomputed keeps",
        "`none-eager-*`",
    ),
    "SOFT_CAPPED_SCORES_KEPT": (
        "soft-capped scores (Gemma 2): one more score set for the tanh",
        "`none-eager-1x1-gemma2-9b-v5e8`",
    ),
    "CHUNKED_ATTENTION_FP32_SCORES": (
        "chunked attention: fp32 score sets per sequence and head, layer in hand",
        "Open Llama 3B's width at 4 layers",
    ),
    "QUANTIZED_KEPT_PER_LAYER": (
        "hidden-sized per token a quantized base keeps per layer beyond bf16's",
        "`q3b`, `q3b1`, `q70b`; int8: the grid's points",
    ),
    "INT4_ONE_CHIP_FP32_COPIES": ("one chip, int4: fp32 copies of the largest projection", "the grid's `w3b` v5e-1"),
    "GATHERED_FP32_COPIES": (
        "across chips, int4 or int8: fp32 copies of the largest projection",
        "Llama 2 70B's shape, v5e-8",
    ),
    "NF4_GATHERED_BF16_COPIES": (
        "across chips, NF4: bf16 copies of the largest projection",
        "Llama 2 70B's shape, v5e-8",
    ),
    "NF4_ONE_CHIP_FP32_COPIES": ("one chip, NF4: fp32 copies of the largest projection", "Llama 3.1 8B, v5e-1"),
    "CHUNKED_LOSS_BLOCKS": ("blocks of logits the chunked loss holds at once", "the grid's chunked loss"),
    "TRAINED_HEAD_LOGITS": (
        "`[tokens, vocab]` buffers of full fine-tuning's trained head under FSDP",
        "the grid's `mini` full, v5e-8",
    ),
    "PREFERENCE_PASS_LOGITS": (
        "a preference step's `[tokens, vocab]` buffers per forward pass, in the SFT step's one",
        "the DPO recipes",
    ),
    "GRADIENT_COPY_BYTES": (
        "full fine-tuning: bytes per trained element held until the optimizer runs",
        "Open Llama 3B on v5e-8, 7B on v5e-16",
    ),
    "UNCALIBRATED_MORE": (
        "how much more than planned a step unlike those above may keep (the plan says so)",
        "`benchmarks/replan_searches.py`",
    ),
}


def terms_table() -> str:
    """docs/tpu_compiler.md: the planner's TPU-layout terms as they are now, what each counts, where it is read."""
    rows = ["| term (`memory/tpu_layout.py`) | value | what it counts | read off |", "|---|---|---|---|"]
    for name, (what, source) in TERMS.items():
        rows.append(f"| `{name}` | {_value(getattr(tpu_layout, name))} | {what} | {source} |")
    return "\n".join(rows)


def plan_errors() -> str:
    """docs/tpu_compiler.md: the planner's error against each compiled shipped recipe (docs/tpu_compile.json), by
    kind of step: read off steps like it, QLoRA, tuned steps unlike those, the tiny demo."""
    groups: dict[str, list[tuple[str, float]]] = {}
    labels = {
        "read": "steps like those the layout is read off (every layer recomputed; or LoRA, flash, none recomputed)",
        "qlora": "QLoRA (an NF4 base), every layer recomputed",
        "tuned": "tuned steps unlike those (the plan says so)",
        "tiny": "the tiny demo (a few MiB: the compiler's fixed costs and on-chip memory)",
    }
    for key, record in json.loads(RECORD.read_text()).items():
        if record.get("plan_error") is None:
            continue
        name, device = key.split("@")
        recipe = _recipe(name, [], device)
        setting = setting_of(recipe, DEVICES[device].devices)
        if name.startswith("tiny"):
            kind = "tiny"
        elif not tpu_layout.calibrated(setting):
            kind = "tuned"
        elif setting.quantize not in (None, "none"):
            kind = "qlora"
        else:
            kind = "read"
        groups.setdefault(kind, []).append((key, record["plan_error"]))
    lines = []
    for kind, label in labels.items():
        found = sorted(groups.get(kind, []), key=lambda item: item[1])
        if not found:
            continue
        (low_key, low), (high_key, high) = found[0], found[-1]
        within = sum(abs(e) <= 0.10 for _, e in found)
        lines.append(
            f"- {label}: {len(found)} compiles, {within} within 10%; from {low:+.1%} (`{low_key}`) "
            f"to {high:+.1%} (`{high_key}`)"
        )
    return "\n".join(lines)
