"""Tables of the planner's own figures (arithmetic, instant; the rows are defined here)."""

from __future__ import annotations

from collections.abc import Callable

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES, GENERATIONS, GiB
from lowmem_tpu.memory.advise import format_report, plan_recipe
from lowmem_tpu.model.build import require_config
from lowmem_tpu.xla.tpu import default_device

from .common import ROOT, shipped_recipe


def devices_table() -> str:
    """docs/memory.md: the catalog of devices ``--target`` names (lowmem_tpu/config/devices.py)."""
    rows = [
        "| `--target` | XLA devices | HBM per XLA device: nominal, usable (planned) | peak bf16 FLOP/s "
        "| HBM bandwidth | compile-only topology | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for device in DEVICES.values():
        chip = GENERATIONS[device.generation]
        unit = "cores, 2 per chip" if chip.devices_per_chip > 1 else ("chip" if device.devices == 1 else "chips")
        usable = f"{chip.usable_bytes / GiB:.4g} GiB" + (" (nominal)" if chip.usable_bytes == chip.hbm_bytes else "")
        about = device.about.split(" (", 1)[1].rstrip(")") if " (" in device.about else ""
        rows.append(
            f"| {device.name} | {device.devices} ({unit}) | {chip.hbm_bytes / GiB:.4g} GiB, {usable} "
            f"| {chip.peak_flops / 1e12:g}e12 | {chip.hbm_bandwidth / 1e9:.0f} GB/s "
            f"| {device.topology or '-'} | {about} |"
        )
    rows.append("| cpu | `runtime.num_cpu_devices` | this machine's RAM / devices | - | - | - | the CPU backend |")
    return "\n".join(rows)


def _chain(then: dict) -> str:
    """The advisor's overrides up to the one that fits: the last value of each field."""
    final = {override.split("=", 1)[0]: override for override in then["overrides"]}
    return " ".join(final.values())


# What fits one TPU: each row a shipped recipe with overrides, planned for its ``runtime.target`` (nothing is
# downloaded: the configs ship with the project) without and with the levers that cost no accuracy (flash
# attention, the TPU's own kernel, and the chunked loss); when a plan does not fit, the overrides of the
# planner's next-step chain, up to the one that makes it fit.
FIT_LEVERS = ["model.attn_implementation=flash", "train.chunked_loss=true"]
FIT_ROWS = {  # name -> (recipe, overrides)
    "Open Llama 3B, LoRA, 4 x 2048 tokens": ("open_llama_lora_v5e1.yaml", ["data.max_length=2048"]),
    "Open Llama 3B, LoRA, 4 x 4096 tokens": ("open_llama_lora_v5e1.yaml", ["data.max_length=4096"]),
    "Open Llama 7B, QLoRA nf4, 4 x 2048 tokens": ("open_llama_7b_qlora.yaml", ["data.max_length=2048"]),
    "Llama 2 70B shape, QLoRA nf4, 16 x 512 tokens": ("llama2_70b_qlora_v5e8.yaml", []),
}


def _fit_plan(recipe: str, overrides: list[str]) -> dict:
    """One row's plan for its target: what it needs, and the advisor's chain up to the override that fits."""
    loaded = load_recipe(ROOT / "recipes" / recipe, [*overrides, "runtime.device=tpu"])
    report = plan_recipe(loaded, loaded.runtime.target, require_config(loaded))
    p = report.plan
    fit = next((i for i, s in enumerate(report.steps) if s.plan.fits), None)
    chain = None if fit is None else report.steps[: fit + 1]
    return {
        "device": report.device.name,
        "needed_gib": p.needed / 2**30,
        "fits": p.fits,
        "then": None
        if chain is None
        else {"overrides": [s.override for s in chain], "needed_gib": chain[-1].plan.needed / 2**30},
    }


def fit_table() -> str:
    """docs/memory.md: what fits one TPU (``FIT_ROWS``), as ``lowmem-tpu memory`` plans it."""

    def cell(row: dict) -> str:
        text = f"{row['needed_gib']:.1f} GiB: {'fits' if row['fits'] else 'does not fit'}"
        if not row["fits"] and row["then"]:
            text += f"; with `{_chain(row['then'])}`: {row['then']['needed_gib']:.1f} GiB"
        return text

    rows = ["| model and step | TPU | as shipped | + flash attention and chunked loss |", "|---|---|---|---|"]
    for name, (recipe, overrides) in FIT_ROWS.items():
        shipped = set(FIT_LEVERS) <= set(overrides) or recipe.startswith("llama2_70b")  # the 70B recipe has them on
        plain, levers = _fit_plan(recipe, overrides), _fit_plan(recipe, [*overrides, *FIT_LEVERS])
        first = "(levers on)" if shipped else cell(plain)
        rows.append(f"| {name} (`{recipe}`) | {plain['device']} | {first} | {cell(levers)} |")
    return "\n".join(rows)


# What fits with a bf16, int8 or int4 base (LoRA): the shipped LoRA recipe with ``model.quantize`` none, int8
# and int4, planned (nothing loaded or compiled). Open Llama 3B v2 on a v5e-8 (Kaggle) as shipped (32 x 1024
# tokens per step, 4 per chip); Open Llama 7B v2 (its shipped config) on a v5e-8 with the same recipe, and on
# one v5e chip (Colab) with 4 sequences of 1024 tokens per step. Every point: LoRA r=16 on all seven
# projections, dropout 0, AdamW, activation checkpointing, FSDP, the model's own LM head (not quantized).
SEVEN_B = "openlm-research/open_llama_7b_v2"
QUANT_POINTS = [  # (label, device, overrides of recipes/open_llama_lora.yaml)
    ("Open Llama 3B v2", "v5e-8", []),
    (
        "Open Llama 7B v2",
        "v5e-1",
        [f"model.name_or_path={SEVEN_B}", "train.global_batch_size=4", "runtime.num_cpu_devices=1"],
    ),
    ("Open Llama 7B v2", "v5e-8", [f"model.name_or_path={SEVEN_B}"]),
]
QUANT_BASES = ("none", "int8", "int4", "nf4")
BASE_LABELS = {
    "none": "bf16",
    "int8": "int8 (+ bf16 scales)",
    "int4": "int4 (+ bf16 scales)",
    "nf4": "nf4 (+ 8-bit maxima)",
}


def quant_fit_table() -> str:
    """docs/qlora.md: what fits with a bf16, int8, int4 or nf4 base (``QUANT_POINTS``), planned in the TPU layout."""
    from lowmem_tpu.memory.plan import plan_setting
    from lowmem_tpu.memory.shape import setting_of, shape_of

    head = "| model | device | base | tokens / device | weights | dequantized | peak | needed (+ margin) | fits? |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for label, device_name, overrides in QUANT_POINTS:
        device = DEVICES[device_name]
        for base in QUANT_BASES:
            recipe = load_recipe(ROOT / "recipes" / "open_llama_lora.yaml", [*overrides, f"model.quantize={base}"])
            st = setting_of(recipe, device.devices)
            p = plan_setting(shape_of(require_config(recipe)), st, "tpu", device.hbm_bytes)
            what = BASE_LABELS[base]
            lines.append(
                f"| {label} | {device_name} ({p.capacity / GiB:.2f} GiB) | {what} | {st.sequences} x {st.length} | "
                f"{p.weights / GiB:.2f} | {p.dequantized / GiB:.2f} | {p.peak / GiB:.2f} | {p.needed / GiB:.2f} | "
                f"{'yes' if p.fits else 'no'} |"
            )
    return "\n".join(lines)


COMPONENTS = [("open_llama_lora", "LoRA"), ("open_llama_full", "full"), ("open_llama_lora_v5e1", "LoRA")]


def components_table() -> str:
    """docs/tpu.md: the Open Llama 3B recipes component by component, per chip (``lowmem-tpu memory``)."""
    from lowmem_tpu.memory.shape import shape_of
    from lowmem_tpu.memory.tpu_layout import layer_in_hand

    columns = []
    for name, mode in COMPONENTS:
        recipe = shipped_recipe(name)
        plan = plan_recipe(recipe, recipe.runtime.target, require_config(recipe)).plan
        layer = layer_in_hand(shape_of(require_config(recipe)), plan.setting)
        columns.append((f"{mode}, {recipe.runtime.target} (`{name}.yaml`)", plan, layer))

    def gib(n: int) -> str:
        return f"{n / GiB:.3g}"

    def optimizer(plan) -> str:
        st = plan.setting
        return f"{gib(plan.optimizer)} ({st.optimizer}{' + fp32 master weights' if st.master_weights else ''})"

    lines = [
        [f"per chip, GiB ({DEVICES['v5e-8'].hbm_bytes / GiB:.2f} usable)", *(c[0] for c in columns)],
        ["weights (bf16 base; LoRA adapters fp32)", *(gib(p.weights) for _, p, _ in columns)],
        ["gradients", *(gib(p.gradients) for _, p, _ in columns)],
        ["optimizer state", *(optimizer(p) for _, p, _ in columns)],
        [
            "activations, checkpointing on (off)",
            *(f"{gib(p.activations_checkpointed)} ({gib(p.activations_not_checkpointed)})" for _, p, _ in columns),
        ],
        ["logits / loss buffers", *(gib(p.logits) for _, p, _ in columns)],
        ["XLA workspace (LM head and a layer gathered)", *(gib(p.workspace) for _, p, _ in columns)],
        [
            "end of backward: gradients and their copies for the optimizer",
            *(gib(p.gradient_phase) if not p.setting.lora else "-" for _, p, _ in columns),
        ],
        ["the layer being recomputed (not printed)", *(gib(layer) for _, _, layer in columns)],
        [
            "peak -> needed (+ 10% + 256 MiB)",
            *(f"{gib(p.peak)} -> {gib(p.needed)}: {'fits' if p.fits else 'does not fit'}" for _, p, _ in columns),
        ],
    ]
    rows = ["| " + " | ".join(lines[0]) + " |", "|---" * len(lines[0]) + "|"]
    rows += ["| " + " | ".join(line) + " |" for line in lines[1:]]
    return "\n".join(rows)


# open_llama_full as it plans with every layer recomputed, eager attention and one micro-batch (docs/memory.md's
# walk through the advisor's chain; the recipe itself ships tune's settings).
FULL_UNTUNED = [
    "sharding.activation_checkpointing=true",
    "train.gradient_accumulation_steps=1",
    "model.attn_implementation=eager",
    "data.packing=false",
]


def memory_output(recipe: str, overrides: list[str] | None = None, device: str | None = None) -> Callable[[], str]:
    """``lowmem-tpu memory RECIPE [--target D] [overrides]``'s output, as the command prints it."""

    def output() -> str:
        loaded = shipped_recipe(recipe, overrides)
        report = plan_recipe(loaded, device or default_device(loaded), require_config(loaded))
        command = " ".join(["lowmem-tpu memory", f"recipes/{recipe}.yaml", *(overrides or [])])
        command += f" --target {device}" if device else ""
        return f"```\n$ {command}\n{format_report(report)}\n```"

    return output
