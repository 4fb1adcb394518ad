"""``lowmem-tpu memory``: a recipe's plan on one device, its twin's, and what to turn on next.

The arithmetic is in :mod:`lowmem_tpu.memory.plan`; this module chains techniques until a plan
fits and renders plans as text or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.checks import flash_tiles
from lowmem_tpu.config.devices import Device, GiB, find_device
from lowmem_tpu.config.features import quantize_refusal
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import host_memory
from lowmem_tpu.memory.plan import Plan, plan_setting
from lowmem_tpu.memory.shape import Setting, Shape, setting_of, shape_of
from lowmem_tpu.memory.tpu_layout import UNCALIBRATED_MORE, calibrated

# ----------------------------------------------------------------------------- what to turn on next


@dataclass(frozen=True)
class Step:
    """One technique turned on, the recipe override that does it, and the plan after it."""

    technique: str
    override: str
    plan: Plan


def _more_sharding(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    if st.strategy == "fsdp" or st.devices == 1:
        return None
    return replace(st, strategy="fsdp"), "shard every weight over all devices (FSDP)", "sharding.strategy=fsdp"


def _checkpointing(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    """Off -> one layer in two -> every layer: each step recomputes more and keeps less."""
    if st.checkpointing and st.checkpoint_every == 1:
        return None
    if not st.checkpointing:
        text = "checkpoint one decoder layer in two (recomputes half the layers)"
        return replace(st, checkpointing=True, checkpoint_every=2), text, "sharding.activation_checkpointing=every_2"
    text = "activation checkpointing on every decoder layer"
    return replace(st, checkpoint_every=1), text, "sharding.activation_checkpointing=true"


def _chunked_loss(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    if st.preference or st.chunked_loss or st.fused_head or s.chunked_loss_refusal:
        return None
    text = "chunked loss (256 positions at a time: no whole [tokens, vocab] logits)"
    return replace(st, chunked_loss=True), text, "train.chunked_loss=true"


def _accumulation(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    steps = st.accumulation * 2
    if st.sequences < 2 or st.global_batch % (steps * st.devices):
        return None
    text = f"half the micro-batch, {steps} accumulation steps (same global batch)"
    return replace(st, accumulation=steps), text, f"train.gradient_accumulation_steps={steps}"


def _attention(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    """No [length, length] scores: flash on a TPU, chunked elsewhere. The TPU compiler keeps far more
    of chunked attention than it plans (Open Llama 3B's width, 4 layers, 4 x 2048 tokens per chip on
    v5e-8: chunked 9.92 GiB, eager 12.39, flash 2.62; benchmarks/tpu_only_paths.py). Flash only at the
    lengths its backward tiles."""
    if st.attention in ("chunked", "flash"):
        return None
    if layout == "tpu" and flash_tiles(st.length) and not s.attention.flash_refusal(st.length):
        text = "flash attention (torch_xla's Pallas kernel: no [length, length] scores)"
        return replace(st, attention="flash"), text, "model.attn_implementation=flash"
    text = "chunked attention (keys in blocks of 128: no [length, length] scores)"
    return replace(st, attention="chunked"), text, "model.attn_implementation=chunked"


def _adafactor(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    if st.lora or st.optimizer == "adafactor":
        return None
    return replace(st, optimizer="adafactor"), "Adafactor (factored optimizer state)", "train.optimizer=adafactor"


def _lora(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    if st.lora:
        return None
    return replace(st, lora=True), "LoRA (freeze the base model)", "lora.enabled=true"


def _quantize(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    """A quantized frozen base: int8 first, then NF4 with double quantization (QLoRA's). Only under LoRA
    (the recipe refuses a quantized base for full fine-tuning)."""
    if not st.lora or st.quantize in ("int4", "nf4"):
        return None
    if st.quantize == "none":
        return replace(st, quantize="int8"), "an int8 base (one scale per output row)", "model.quantize=int8"
    what = f"QLoRA's 4-bit NormalFloat, blocks of {st.group_size}, double quantization"
    return replace(st, quantize="nf4", double_quant=True), f"an nf4 base ({what})", "model.quantize=nf4"


def _shorter(st: Setting, s: Shape, layout: str) -> tuple[Setting, str, str] | None:
    if st.length <= 256:
        return None
    length = st.length // 2
    return replace(st, length=length), f"shorter sequences ({length} tokens)", f"data.max_length={length}"


# Cheapest first: sharding, accumulation and the chunked loss cost (almost) no speed, flash or
# chunked attention some, checkpointing recomputes layers' forward passes (half, then all); then
# what changes the training itself. TRL's fused head (which doubles the XLA step time) is left for
# when the chunked loss cannot be used.
TECHNIQUES = (
    _more_sharding,
    _accumulation,
    _chunked_loss,
    _attention,
    _checkpointing,
    _adafactor,
    _lora,
    _quantize,
    _shorter,
)

# Doubling accumulation again is suggested only when it lowers the peak by this share (halving
# the micro-batch again and again for a few MiB reads as noise) or nothing else is left.
MIN_SAVING = 0.03


def next_steps(s: Shape, plan: Plan) -> list[Step]:
    """Techniques to turn on, one at a time in this order, until the plan fits or none is left.

    The first that lowers the peak is taken; doubling accumulation again must save ``MIN_SAVING``
    of it (else it comes only when nothing else is left).
    Quantizing the base is suggested only once LoRA is on: full fine-tuning trains the base itself.
    """
    steps: list[Step] = []
    while not plan.fits:
        found = _next(s, plan, MIN_SAVING) or _next(s, plan, 0.0)
        if found is None:
            return steps
        steps.append(found)
        plan = found.plan
    return steps


def _loss_kind(st: Setting) -> str:
    if st.preference:
        reference = "reference precomputed" if METHODS[st.method].reference else "no reference"
        passes = f"{st.forward_passes} forward pass{'es' if st.forward_passes > 1 else ''}"
        return f"{st.method.upper()}: TRL's LM head, {passes}" + ("" if st.reference_pass else f", {reference}")
    return "chunked loss" if st.chunked_loss else "TRL's fused head" if st.fused_head else "full logits"


def _next(s: Shape, plan: Plan, repeat_saving: float) -> Step | None:
    """The first technique that lowers the peak (by ``repeat_saving`` when it doubles accumulation again)."""
    for technique in TECHNIQUES:
        change = technique(plan.setting, s, plan.layout)
        if change is None:
            continue
        candidate = plan_setting(s, change[0], plan.layout, plan.capacity)
        repeat = technique is _accumulation and plan.setting.accumulation > 1
        if candidate.peak < plan.peak * (1 - (repeat_saving if repeat else 0.0)):
            return Step(change[1], change[2], candidate)
    return None


# ----------------------------------------------------------------------------- a recipe: plan, twin, next steps


@dataclass(frozen=True)
class MemoryReport:
    """The recipe's plan on one device, its twin's (LoRA <-> full), and what to turn on when either does not fit."""

    device: Device
    model: str
    plan: Plan
    twin: Plan
    steps: list[Step]
    twin_steps: list[Step]


def plan_recipe(recipe: Recipe, device: str, config: Any) -> MemoryReport:
    """Plan ``recipe`` on ``device`` (a name from :data:`DEVICES` or ``cpu``) for the model ``config``
    (``model.build.require_config``: the caller reads it, so the planner imports no model code)."""
    target = find_device(device, recipe.runtime.num_cpu_devices, host_memory())
    shape = shape_of(config)
    data = recipe.data
    refusal = shape.attention.refusal(recipe.model.attn_implementation, data.packing, data.max_length)
    refusal = refusal or quantize_refusal(config, recipe.model.quantize)
    if refusal:
        raise UserError(refusal)
    layout = "cpu" if target.name == "cpu" else "tpu"
    st = setting_of(recipe, target.devices)
    plan = plan_setting(shape, st, layout, target.hbm_bytes)
    # The twin of a QLoRA recipe is full fine-tuning of the unquantized base.
    twin = plan_setting(shape, replace(st, lora=not st.lora, quantize="none"), layout, target.hbm_bytes)
    return MemoryReport(target, recipe.model.name_or_path, plan, twin, next_steps(shape, plan), next_steps(shape, twin))


# ----------------------------------------------------------------------------- output


def _mode(st: Setting) -> str:
    if not st.lora:
        return "full fine-tuning"
    if st.quantize == "none":
        return "LoRA"
    head = ", LM head too" if st.quantize_lm_head else ""
    if st.quantize == "nf4":
        double = ", double quantization" if st.double_quant else ""
        return f"LoRA on an nf4 base (blocks of {st.group_size}{double}{head})"
    group = f", groups of {st.group_size}" if st.quantize == "int4" else ""
    return f"LoRA on an {st.quantize} base ({st.dtype} scales{group}{head})"


def plan_rows(plan: Plan) -> list[tuple[str, int]]:
    """(label, bytes) per component, in display order."""
    st = plan.setting
    every = f"one layer in {st.checkpoint_every}" if st.checkpoint_every > 1 else "on"
    ckpt = every if st.checkpointing else "off"
    scales = ("8-bit maxima" if st.double_quant else "fp32 maxima") if st.quantize == "nf4" else f"{st.dtype} scales"
    base = f" ({st.quantize} base + {scales})" if plan.dequantized else ""
    code = "; the experts' kernel code" if plan.kernel_code else ""
    rows = [
        (f"weights{base}", plan.weights),
        ("gradients", plan.gradients),
        (f"optimizer states ({st.optimizer}{' + fp32 master weights' if st.master_weights else ''})", plan.optimizer),
        (f"activations (checkpointing {ckpt}, used)", plan.activations),
        *([("  of which LoRA dropout's random bits", plan.dropout_masks)] if plan.dropout_masks else []),
        (
            f"activations (checkpointing {'off' if st.checkpointing else 'on'})",
            plan.activations_not_checkpointed if st.checkpointing else plan.activations_checkpointed,
        ),
        (f"logits / loss buffers ({_loss_kind(st)})", plan.logits),
        (
            f"XLA workspace (LM head{' and a layer' if plan.layout == 'tpu' else ''} gathered{code})",
            plan.workspace,
        ),
        *([(_quantized_label(plan), plan.dequantized)] if plan.dequantized else []),
    ]
    if not st.lora:
        whole = " all-reduced whole (CPU)" if plan.layout == "cpu" and st.devices > 1 else ""
        tail = " + 1 layer" if plan.layout == "cpu" else " and their copies for the optimizer"
        rows.append((f"end of backward: gradients{whole}{tail}", plan.gradient_phase))
    return [*rows, ("peak", plan.peak), ("margin for XLA workspace (10% + 256 MiB)", plan.margin)]


def _quantized_label(plan: Plan) -> str:
    st = plan.setting
    if plan.layout == "tpu" and st.devices > 1 and st.strategy == "fsdp":  # beyond a bf16 base: memory.tpu_layout
        return "a quantized base's extra activations (every layer)"
    if plan.layout == "tpu":
        return f"the {st.quantize} base's fp32 dequantization (one chip)"
    return f"dequantized weights ({plan.setting.dtype}, transient)"


def gib(n: float) -> str:
    """Bytes as GiB with three significant digits."""
    return f"{n / GiB:.3g} GiB"


# The TPU plan's band against the compiler where its layout is read off steps like the one planned
# (tests/unit/test_memory_plan.py): a peak this close to the chip is the compiler's to judge.
EDGE = 0.10


def on_the_edge(plan: Plan) -> bool:
    """A TPU plan that does not fit with its margin but whose peak is within the planner's band of the chip."""
    return plan.layout == "tpu" and not plan.fits and plan.peak <= plan.capacity * (1 + EDGE)


def _verdict(plan: Plan) -> str:
    room = plan.capacity - plan.needed
    state = f"fits ({gib(room)} free)" if room >= 0 else f"does not fit ({gib(-room)} short)"
    if on_the_edge(plan):
        state = (
            f"on the edge: the peak, {gib(plan.peak)}, is within the planner's {EDGE:.0%} of the chip; "
            "--compile gives the TPU compiler's verdict"
        )
    return f"{gib(plan.needed)} of {gib(plan.capacity)}: {state}"


def together(steps: list[Step]) -> str:
    """The chain's overrides as one command line: the last value of each field (accumulation 2, 4, 8 -> 8)."""
    final = {step.override.split("=", 1)[0]: step.override for step in steps}
    return " ".join(final.values())


def format_plan(title: str, plan: Plan, steps: list[Step]) -> list[str]:
    """One plan as text: its components in bytes and GiB, the verdict, and the next steps."""
    st = plan.setting
    lines = [
        f"{title}: {_mode(st)}, {plan.trainable_parameters:,} trainable of {plan.total_parameters:,} parameters"
        + (f" (a token goes through {plan.active_base_parameters:,} of the base's)" if plan.idle_parameters else ""),
        f"  micro-batch {st.sequences} x {st.length} tokens per device, {st.accumulation} accumulation step(s)",
    ]
    lines += [f"  {label:<48}{value:>18,} B  {gib(value):>11}" for label, value in plan_rows(plan)]
    lines.append(f"  needed: {_verdict(plan)}")
    for i, step in enumerate(steps, 1):
        lines.append(f"    {i}. + {step.technique}  [{step.override}]  -> {_verdict(step.plan)}")
    if len(steps) > 1 and steps[-1].plan.fits:
        lines.append(f"    all together: {together(steps)}")
    if not plan.fits and (not steps or not steps[-1].plan.fits):
        lines.append("    nothing left to turn on: use a larger TPU or a smaller model")
    return lines


# Below this peak per chip a TPU plan is rough (docs/memory.md, "Against the TPU compiler"): the compiler
# keeps small buffers in the chip's VMEM and one 16 KiB slot per tuple table, which no shape gives; the
# grid's points at Open Llama 3B's width (1.0 to 4.2 GiB) are within 10%, those below 1 GiB from -69% to +347%.
ROUGH_BELOW = GiB


def small_plan_note(plan: Plan) -> str | None:
    """What to read instead of a TPU plan the planner's layout is not within 10% for: a step too small, or
    one unlike the checkpointed steps the layout is read off (``tpu_layout.calibrated``)."""
    if plan.layout != "tpu":
        return None
    if plan.peak < ROUGH_BELOW:
        return (
            f"a TPU step under {gib(ROUGH_BELOW)} per chip is planned roughly (off by up to 4.5x: the compiler "
            "keeps small buffers in on-chip VMEM and has fixed costs); --compile gives the TPU compiler's own figure"
        )
    if not calibrated(plan.setting):
        return (
            "the TPU layout is read off steps that recompute every layer in one micro-batch, or LoRA steps with "
            "flash and no layer recomputed: here the compiler "
            f"keeps up to {UNCALIBRATED_MORE:.0%} more than planned (`lowmem-tpu tune`'s candidates); --compile "
            "gives the TPU compiler's own figure"
        )
    return None


def twin_overrides(plan: Plan) -> list[str]:
    """The overrides that turn the recipe into its twin (LoRA <-> full, a quantized base in bf16)."""
    twin = ["lora.enabled=false" if plan.setting.lora else "lora.enabled=true"]
    return twin + (["model.quantize=none"] if plan.setting.quantize != "none" else [])


def format_report(report: MemoryReport) -> str:
    """The ``lowmem-tpu memory`` output."""
    d = report.device
    twin = " ".join(twin_overrides(report.plan))
    lines = [f"{report.model} on {d.name} ({d.about}), per device ({report.plan.layout} layout)", ""]
    lines += [*format_plan("the recipe", report.plan, report.steps), ""]
    if note := small_plan_note(report.plan):
        lines += [f"note: {note}", ""]
    lines += format_plan(f"its twin ({twin})", report.twin, report.twin_steps)
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    """A plan as plain data: every component in bytes, the setting, the verdict."""
    keys = [
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "activations_checkpointed",
        "activations_not_checkpointed",
        "dropout_masks",
        "logits",
        "workspace",
        "gradient_phase",
        "dequantized",
        "peak",
        "margin",
        "capacity",
    ]
    return {
        "mode": "lora" if plan.setting.lora else "full",
        "setting": plan.setting.__dict__ | {"targets": list(plan.setting.targets)},
        "layout": plan.layout,
        "trainable_parameters": plan.trainable_parameters,
        "total_parameters": plan.total_parameters,
        "bytes": {key: getattr(plan, key) for key in keys} | {"persistent": plan.persistent, "needed": plan.needed},
        "fits": plan.fits,
        "on_the_edge": on_the_edge(plan),
    }


def report_json(report: MemoryReport) -> dict[str, Any]:
    """The ``--json`` output of ``lowmem-tpu memory``."""

    def steps(items: list[Step]) -> list[dict[str, Any]]:
        return [{"technique": s.technique, "override": s.override, "plan": plan_json(s.plan)} for s in items]

    return {
        "model": report.model,
        "device": report.device.__dict__,
        "recipe": plan_json(report.plan) | {"next_steps": steps(report.steps), "note": small_plan_note(report.plan)},
        "twin": plan_json(report.twin)
        | {"overrides": twin_overrides(report.plan), "next_steps": steps(report.twin_steps)},
    }
