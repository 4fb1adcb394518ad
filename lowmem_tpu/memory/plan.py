"""The memory planner: per-device bytes of a recipe's training step, from arithmetic alone.

Nothing here imports torch or torch_xla. The inputs are a transformers config (or
anything with the same attributes) and the recipe; the output is, per device, the
weights, gradients and optimizer state (exact: the same shard rule as
``xla.sharding.partition_spec``), the activations and logits buffers (a model of what XLA
keeps live, calibrated against the CPU compiler: see docs/memory.md), and a margin for
XLA's workspace. ``advise`` builds on it: the recipe's twin (LoRA <-> full
fine-tuning), what to turn on when a plan does not fit, and the command's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lowmem_tpu.memory import tpu_layout
from lowmem_tpu.memory.cpu_layout import (
    DTYPE_BYTES,
    activations,
    backward_workspace,
    dequantized_bytes,
    dropout_masks,
    kept_for_backward,
    layer_activations,
    logits_bytes,
    quantized,
)
from lowmem_tpu.memory.shape import EXPERT_STACKS, Setting, Shape, linears
from lowmem_tpu.memory.tiles import shard_shape, tpu_shard_bytes

# ----------------------------------------------------------------------------- parameters and persistent state


@dataclass(frozen=True)
class Tensor:
    """One parameter: its shape, bytes per element and whether it trains.

    ``stands_for`` is how many model parameters it holds when that is not its element count: a
    quantized weight stands for ``out * in`` weights (two per byte packed in int4), its scales for none.
    """

    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    stands_for: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def parameters(self) -> int:
        """Model parameters it holds (what ``modeling.count_parameters`` counts)."""
        return self.numel if self.stands_for is None else self.stands_for


def quantized_weight(out: int, inp: int, st: Setting) -> list[Tensor]:
    """``QuantizedLinear``'s frozen ``qweight`` and ``scale``: int8 ``[out, in]`` with one scale per row,
    int4 packed two per byte ``[ceil(in/g)*g/2, out]`` (``model.nibbles``' layout) with ``[out, ceil(in/g)]``
    scales (model dtype), or nf4 packed ``[in/2, out]`` (the same layout) with ``[out, in/g]`` fp32 maxima, or
    with double quantization u8 maxima and an fp32 scale per 256 of them."""
    size = DTYPE_BYTES[st.dtype]
    if st.quantize == "nf4":
        blocks = math.ceil(out * inp / st.group_size)  # a flat vector when blocks cross rows
        shape = (out, inp // st.group_size) if inp % st.group_size == 0 else (blocks,)
        maxima = [Tensor(shape, 1 if st.double_quant else 4, False, 0)]
        second = [Tensor((math.ceil(blocks / 256),), 4, False, 0)] if st.double_quant else []
        return [Tensor((inp // 2, out), 1, False, out * inp), *maxima, *second]
    if st.bits == 8:
        return [Tensor((out, inp), 1, False, out * inp), Tensor((out,), size, False, 0)]
    groups = math.ceil(inp / st.group_size)
    return [
        Tensor((groups * st.group_size // 2, out), 1, False, out * inp),
        Tensor((out, groups), size, False, 0),
    ]


def parameters(s: Shape, st: Setting) -> list[Tensor]:
    """Every parameter of the model as ``lowmem-tpu sft`` builds it (LoRA adapters in ``lora.dtype``)."""
    size, full = DTYPE_BYTES[st.dtype], not st.lora
    base = quantized(st)
    out = [Tensor((s.vocab, s.hidden), size, full), Tensor((s.hidden,), size, full)]
    if not s.tied:
        head = base and st.quantize_lm_head
        out += quantized_weight(s.vocab, s.hidden, st) if head else [Tensor((s.vocab, s.hidden), size, full)]
    for projections, count in [(p, 1) for p in s.layer_linears] or [(linears(s), s.layers)]:
        for name, (o, i) in projections.items():
            bias = s.attention_bias if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else s.mlp_bias
            weight = quantized_weight(o, i, st) if base else [Tensor((o, i), size, full)]
            layer = weight + ([Tensor((o,), size, full)] if bias else [])
            if st.lora and (name in st.targets or (st.all_linear and "." not in name)):  # "." : a stack
                adapter = DTYPE_BYTES[st.adapter_dtype]
                layer += [Tensor((st.rank, i), adapter, True), Tensor((o, st.rank), adapter, True)]
            elif st.lora and s.experts and set(EXPERT_STACKS.get(name, ())) & set(st.targets):
                adapter, per_expert = DTYPE_BYTES[st.adapter_dtype], st.rank * s.experts.count
                layer += [
                    Tensor((per_expert, i), adapter, True),
                    Tensor((o // s.experts.count, per_expert), adapter, True),
                ]
            out += layer * count
    out += [Tensor((s.hidden,), size, full)] * (2 * s.layers)
    towers = [Tensor((s.towers,), size, False)] if s.towers else []  # frozen even in full fine-tuning
    return out + [Tensor(shape, size, full) for shape in s.other_weights] + towers


def shard_numel(shape: tuple[int, ...], strategy: str, devices: int) -> int:
    """Elements per device: FSDP splits the largest dimension (the first of equals), XLA pads uneven shards."""
    return math.prod(shard_shape(shape, strategy, devices))


def _bytes(tensors: list[Tensor], st: Setting, tiled: bool = False) -> int:
    """Bytes per device of ``tensors``' shards; ``tiled``: padded to a TPU's tiles, as its HBM holds them."""
    if tiled:
        return sum(tpu_shard_bytes(t.shape, t.itemsize, st.strategy, st.devices) for t in tensors)
    return sum(shard_numel(t.shape, st.strategy, st.devices) * t.itemsize for t in tensors)


def optimizer_bytes(trainable: list[Tensor], st: Setting, tiled: bool = False) -> int:
    """AdamW: two states shaped and typed like each parameter. Adafactor: fp32 row and column factors,
    each split over the devices when it runs along the parameter's sharded dimension (measured).
    Master weights: an fp32 copy of each low-precision parameter, sharded like it, which AdamW's
    states then follow (fp32)."""
    copied = [st.master_weights and t.itemsize < 4 for t in trainable]
    masters = [Tensor(t.shape, 4, True) for t, c in zip(trainable, copied, strict=True) if c]
    fp32 = [t for t, c in zip(trainable, copied, strict=True) if not c] + masters
    if st.optimizer == "adamw":
        return 2 * _bytes(fp32, st, tiled) + _bytes(masters, st, tiled)
    total = _bytes(masters, st, tiled)
    for t in trainable:
        if len(t.shape) < 2:
            total += shard_numel(t.shape, st.strategy, st.devices) * 4
            continue
        axis = max(range(len(t.shape)), key=lambda i: t.shape[i]) if st.strategy == "fsdp" else -1
        rows, cols = math.prod(t.shape[:-1]), math.prod(t.shape[:-2]) * t.shape[-1]
        total += (math.ceil(rows / st.devices) if axis == 0 else rows) * 4
        total += (math.ceil(cols / st.devices) if axis == len(t.shape) - 1 else cols) * 4
    return total


# ----------------------------------------------------------------------------- one plan


@dataclass(frozen=True)
class Plan:
    """Per-device bytes of one setting. ``peak`` is what the step needs; ``margin`` is kept free on top."""

    setting: Setting
    layout: str  # "tpu", or "cpu": as the CPU compiler lays the step out (see gradient_phase)
    trainable_parameters: int
    total_parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int  # with the setting's checkpointing, LoRA dropout's random bits included
    activations_checkpointed: int
    activations_not_checkpointed: int
    dropout_masks: int  # part of activations: LoRA dropout's random bits (see dropout_masks)
    logits: int
    workspace: int  # the LM head gathered whole for the logits (FSDP, more than one device); TPU: and a layer,
    # and a MoE model's grouped-matmul kernels' programs
    gradient_phase: int  # gradients at the end of the backward pass (CPU: all-reduced whole, not sharded)
    dequantized: int  # a quantized base's transient (CPU: dequantized weights; TPU: its layers' extra activations)
    peak: int
    margin: int
    capacity: int  # memory per device
    kernel_code: int = 0  # part of workspace: a MoE model's grouped-matmul kernels' programs (TPU)
    idle_parameters: int = 0  # a MoE model's: the expert weights a token does not go through

    @property
    def active_base_parameters(self) -> int:
        """The base's weights a token goes through (a MoE model's: its router's top-k experts, not all)."""
        adapters = self.trainable_parameters if self.setting.lora else 0
        return self.total_parameters - adapters - self.idle_parameters

    @property
    def persistent(self) -> int:
        """Weights, gradients and optimizer state: what the sharded tensors hold."""
        return self.weights + self.gradients + self.optimizer

    @property
    def needed(self) -> int:
        """The peak plus the margin kept free."""
        return self.peak + self.margin

    @property
    def fits(self) -> bool:
        """True when what is needed is at most the device's memory."""
        return self.needed <= self.capacity


def margin_for(peak: int) -> int:
    """Kept free for XLA's workspace, the runtime and fragmentation: 10% of the peak plus 256 MiB."""
    return peak // 10 + 256 * 2**20


def plan_setting(s: Shape, st: Setting, layout: str, capacity: int) -> Plan:
    """Plan one setting: persistent state from the shard rule, the rest from the layout's activation model.

    CPU: peak = weights + optimizer + max(max(loss phase, layer phase) + dequantized, gradient phase)
    TPU: see :func:`tpu_plan`.
    """
    if layout == "tpu":
        return tpu_plan(s, st, capacity)
    params = parameters(s, st)
    trainable = [p for p in params if p.trainable]
    e = DTYPE_BYTES[st.dtype]
    weights, gradients = _bytes(params, st), _bytes(trainable, st)
    optimizer = optimizer_bytes(trainable, st)
    head = s.vocab * s.hidden * e
    # The LM head gathered whole for the logits; a quantized head is dequantized whole even on one device.
    gathered = st.devices > 1 and st.strategy == "fsdp"
    workspace = head if gathered or (quantized(st) and st.quantize_lm_head and not s.tied) else 0
    dequantized = dequantized_bytes(s, st)
    gradient_phase = gradients
    if layout == "cpu" and not st.lora and st.devices > 1:
        # No reduce-scatter on the CPU backend: every gradient is all-reduced whole (and the
        # LM head's twice) before each device slices its shard for the optimizer.
        gradient_phase = sum(t.numel * t.itemsize for t in trainable) + head
    if not st.lora:
        gradient_phase += layer_activations(s, st)  # the first layer's backward, with the rest's gradients done
    act, lg = activations(s, st, layout) + dropout_masks(s, st, layout), logits_bytes(s, st)
    # Two moments of the backward pass: the loss's (its buffers and the gathered head, beside what
    # the forward pass kept), then each layer's (its recomputed activations and gradient buffers).
    loss_phase = kept_for_backward(s, st, layout) + dropout_masks(s, st, layout) + lg + workspace
    layer_phase = act + backward_workspace(s, st)
    transient = max(loss_phase, layer_phase) + dequantized + (gradients if st.lora else 0)
    peak = weights + optimizer + max(transient, gradient_phase)
    return Plan(
        setting=st,
        layout=layout,
        trainable_parameters=sum(t.numel for t in trainable),
        total_parameters=sum(t.parameters for t in params),
        idle_parameters=s.experts.idle(s.hidden) if s.experts else 0,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=act,
        activations_checkpointed=activations(s, st, layout, True)
        + dropout_masks(s, replace(st, checkpointing=True), layout),
        activations_not_checkpointed=activations(s, st, layout, False)
        + dropout_masks(s, replace(st, checkpointing=False), layout),
        dropout_masks=dropout_masks(s, st, layout),
        logits=lg,
        workspace=workspace,
        gradient_phase=gradient_phase,
        dequantized=dequantized,
        peak=peak,
        margin=margin_for(peak),
        capacity=capacity,
    )


def tpu_plan(s: Shape, st: Setting, capacity: int) -> Plan:
    """Plan one setting as libtpu's compiler lays the step out (:mod:`lowmem_tpu.memory.tpu_layout`).

    peak = weights + optimizer + gradients + max(loss phase, layer phase) + gathered weights
           + full fine-tuning's gradient copies + a quantized base's extra activations + dropout's bits
    """
    params = parameters(s, st)
    trainable = [p for p in params if p.trainable]
    weights, gradients = _bytes(params, st, tiled=True), _bytes(trainable, st, tiled=True)
    optimizer = optimizer_bytes(trainable, st, tiled=True)
    elements = sum(shard_numel(t.shape, st.strategy, st.devices) for t in trainable)
    t = tpu_layout.transients(s, st, elements)
    dropout = dropout_masks(s, st, "tpu")
    peak = weights + optimizer + gradients + t.peak + dropout
    return Plan(
        setting=st,
        layout="tpu",
        trainable_parameters=sum(p.numel for p in trainable),
        total_parameters=sum(p.parameters for p in params),
        idle_parameters=s.experts.idle(s.hidden) if s.experts else 0,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=t.kept + dropout,
        activations_checkpointed=t.kept_checkpointed + dropout_masks(s, replace(st, checkpointing=True), "tpu"),
        activations_not_checkpointed=t.kept_not_checkpointed
        + dropout_masks(s, replace(st, checkpointing=False), "tpu"),
        dropout_masks=dropout,
        logits=t.logits,
        workspace=t.gathered + t.code,
        kernel_code=t.code,
        gradient_phase=gradients + t.gradients,
        dequantized=t.dequantized,
        peak=peak,
        margin=margin_for(peak),
        capacity=capacity,
    )
