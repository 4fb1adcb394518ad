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

from lowmem_tpu.config.rules import loss_block
from lowmem_tpu.memory import tpu_layout
from lowmem_tpu.memory.shape import Setting, Shape, linears
from lowmem_tpu.memory.tiles import tpu_shard_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


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
    or int4 packed two per byte ``[out, ceil(in/g)*g/2]`` with ``[out, ceil(in/g)]`` scales (model dtype)."""
    size = DTYPE_BYTES[st.dtype]
    if st.bits == 8:
        return [Tensor((out, inp), 1, False, out * inp), Tensor((out,), size, False, 0)]
    groups = math.ceil(inp / st.group_size)
    return [
        Tensor((out, groups * st.group_size // 2), 1, False, out * inp),
        Tensor((out, groups), size, False, 0),
    ]


def parameters(s: Shape, st: Setting) -> list[Tensor]:
    """Every parameter of the model as ``lowmem-tpu sft`` builds it (LoRA adapters in fp32, as PEFT keeps them)."""
    size, full = DTYPE_BYTES[st.dtype], not st.lora
    base = quantized(st)
    out = [Tensor((s.vocab, s.hidden), size, full), Tensor((s.hidden,), size, full)]
    if not s.tied:
        head = base and st.quantize_lm_head
        out += quantized_weight(s.vocab, s.hidden, st) if head else [Tensor((s.vocab, s.hidden), size, full)]
    for name, (o, i) in linears(s).items():
        bias = s.attention_bias if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else s.mlp_bias
        weight = quantized_weight(o, i, st) if base else [Tensor((o, i), size, full)]
        layer = weight + ([Tensor((o,), size, full)] if bias else [])
        if st.lora and name in st.targets:
            layer += [Tensor((st.rank, i), 4, True), Tensor((o, st.rank), 4, True)]
        out += layer * s.layers
    out += [Tensor((s.hidden,), size, full)] * (2 * s.layers)
    return out


def shard_numel(shape: tuple[int, ...], strategy: str, devices: int) -> int:
    """Elements per device: FSDP splits the largest dimension (the first of equals), XLA pads uneven shards."""
    if strategy != "fsdp" or not shape:
        return math.prod(shape)
    axis = max(range(len(shape)), key=lambda i: shape[i])
    return math.prod(math.ceil(d / devices) if i == axis else d for i, d in enumerate(shape))


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


# ----------------------------------------------------------------------------- activations and workspace


def layer_activations(s: Shape, st: Setting) -> int:
    """Bytes one decoder layer keeps for its backward pass, per device.

    Counted in the compiler's buffers (fp32 Llama): 8 hidden-sized tensors per token (norm
    outputs, residuals, q/k/v, attention output), 5 intermediate-sized ones (gate, up, SiLU,
    product, down's input), 2 more when LoRA adapts gate/up, and the softmax probabilities
    (batch x heads x length^2, in fp32).
    """
    e = DTYPE_BYTES[st.dtype]
    lora_mlp = sum(1 for name in ("gate_proj", "up_proj") if st.lora and name in st.targets)
    per_token = (8 * s.hidden + (5 + lora_mlp) * s.intermediate) * e
    return st.tokens * per_token + attention_scores(s, st)


# Keys per block of chunked attention (lowmem_tpu.model.attention.BLOCK).
ATTENTION_BLOCK = 128


def score_buffer(s: Shape, st: Setting) -> int:
    """One fp32 buffer of attention scores per device: [sequences, heads, length, length] for
    eager/sdpa, one block of keys wide for chunked/flash."""
    keys = min(ATTENTION_BLOCK, st.length) if st.attention in ("chunked", "flash") else st.length
    return st.live_sequences * s.heads * st.length * keys * 4


def attention_scores(s: Shape, st: Setting) -> int:
    """The softmax's buffers per layer: eager/sdpa keep [sequences, heads, length, length] fp32 scores;
    chunked/flash one block of keys at a time (scores and probabilities, fp32) plus an fp32 output."""
    if st.attention in ("chunked", "flash"):
        return 2 * score_buffer(s, st) + st.tokens * s.hidden * 4
    return score_buffer(s, st)


def checkpointed_layers(s: Shape, st: Setting) -> int:
    """Decoder layers recomputed in the backward pass: all, one in ``checkpoint_every``, or none."""
    return -(-s.layers // st.checkpoint_every) if st.checkpointing else 0


def activations(s: Shape, st: Setting, layout: str, checkpointing: bool | None = None) -> int:
    """Activation bytes per device at the start of the backward pass.

    A layer that is not checkpointed keeps all its activations. A checkpointed one keeps only its
    input (plus the residual stream once), and one layer at a time is recomputed (when the backward
    pass reaches it, the later layers' activations are gone). The CPU
    compiler on one device was seen keeping each layer's attention (q, k, v and the softmax
    numerator) from the forward pass anyway (XLA:CPU drops the optimization barriers that keep
    recomputation in place): that is modelled in the CPU layout only, never in a TPU plan.
    """
    on = st.checkpointing if checkpointing is None else checkpointing
    if not on:
        return s.layers * layer_activations(s, st)
    if cpu_drops_checkpointing(st, layout):  # every layer's per-token activations, one layer's scores
        return s.layers * (layer_activations(s, st) - attention_scores(s, st)) + attention_scores(s, st)
    st = replace(st, checkpointing=True)
    e, recomputed = DTYPE_BYTES[st.dtype], checkpointed_layers(s, st)
    # The backward pass frees each layer's activations as it passes: one recomputed layer at a time,
    # or the layers that keep theirs (the last layer's backward runs first).
    kept = (recomputed + 1) * st.tokens * s.hidden * e + max(s.layers - recomputed, 1) * layer_activations(s, st)
    if layout == "cpu" and st.devices == 1:
        kept += recomputed * (3 * st.tokens * s.hidden * e + attention_scores(s, st))
    return kept


def kept_for_backward(s: Shape, st: Setting, layout: str) -> int:
    """What the forward pass leaves for the backward pass as the loss's backward runs: every layer's
    activations without checkpointing, else the checkpointed layers' inputs and the other layers'
    activations; on a TPU no layer is being recomputed yet.

    The CPU layout adds what XLA:CPU, which drops the optimization barriers, does besides: one
    layer's recomputation already under way beside the whole logits (one program per step, the
    model's own loss: measured on the 162M and ``mini`` grids, not with the chunked loss or with
    accumulation), and on one device each layer's attention kept from the forward pass."""
    if not st.checkpointing:
        return s.layers * layer_activations(s, st)
    e, recomputed = DTYPE_BYTES[st.dtype], checkpointed_layers(s, st)
    kept = (recomputed + 1) * st.tokens * s.hidden * e + (s.layers - recomputed) * layer_activations(s, st)
    if layout == "cpu" and st.accumulation == 1 and not (st.chunked_loss or st.fused_head):
        kept += layer_activations(s, st)
    if layout == "cpu" and st.devices == 1:
        kept += recomputed * (3 * st.tokens * s.hidden * e + attention_scores(s, st))
    return kept


def cpu_drops_checkpointing(st: Setting, layout: str) -> bool:
    """With accumulation each micro-batch's program ends at its gradients, and XLA:CPU, which drops
    optimization barriers, then merges the recomputed forward pass with the first one: every layer
    keeps its per-token activations, the attention scores only the layer in hand (measured, tiny
    Llama, 4 CPU devices, 4 micro-batches of 16 x 128 tokens:
    30.7 MiB with checkpointing, 32.8 without; one program of 64 sequences: 43.5 with, 127 without).
    A TPU keeps the barriers: this is a CPU-layout effect only."""
    return layout == "cpu" and st.accumulation > 1 and st.checkpointing


def dropout_masks(s: Shape, st: Setting, layout: str) -> int:
    """LoRA dropout's random bits, per device: 32 bits per input of each adapted projection.

    CPU: XLA's SPMD partitioner does not split random-number generation, so every device draws the
    bits of the whole micro-batch (all devices' sequences); the compiler keeps one layer's (all
    layers' without checkpointing). TPU: libtpu's ``xla_tpu_spmd_rng_bit_generator_unsafe``
    (``xla/runtime.py`` sets it) has each chip draw its own sequences' bits, but every layer's are
    kept for the backward pass, checkpointed or not (the recomputation draws the same bits from the
    same state, which XLA reuses): measured by the TPU compiler on Open Llama 3B's width, 4 layers,
    4 x 1024 tokens per chip on v5e-8, 1.58 GiB over no dropout where this gives 1.70.
    """
    if not st.lora or st.lora_dropout == 0:
        return 0
    inputs = sum(i for name, (_, i) in linears(s).items() if name in st.targets)
    if layout == "tpu":
        return s.layers * st.live_sequences * st.length * inputs * 4
    layers = s.layers - checkpointed_layers(s, st) + 1 if st.checkpointing else s.layers
    return layers * st.live_sequences * st.devices * st.length * inputs * 4


def backward_workspace(s: Shape, st: Setting) -> int:
    """Gradient buffers of one layer's backward pass, the larger of its two halves: the MLP's (two
    intermediate-sized, four hidden-sized per token) and attention's (the softmax's and the scores'
    gradients beside the kept probabilities: two more score buffers, four hidden-sized per token,
    and chunked attention's fp32 key and value gradients; measured on the CPU compiler, tiny Llama
    at 512 tokens: three [sequences, heads, 512, 512] fp32 buffers live at the peak)."""
    e = DTYPE_BYTES[st.dtype]
    mlp = st.tokens * (2 * s.intermediate + 4 * s.hidden) * e
    attention = 2 * score_buffer(s, st) + 4 * st.tokens * s.hidden * e
    if st.attention in ("chunked", "flash"):
        attention += 2 * st.tokens * s.hidden * 4
    return max(mlp, attention)


# How many projections' dequantized weights (the largest projection's size, whole, in the compute
# dtype) are live at the peak besides what an unquantized base keeps: calibrated against the CPU
# compiler (docs/memory.md, "A quantized base").
DEQUANTIZED_PROJECTIONS = 1


def quantized(st: Setting) -> bool:
    """Whether the base's decoder linears are quantized (the recipe allows it only with LoRA)."""
    return st.lora and st.bits > 0


def dequantized_bytes(s: Shape, st: Setting) -> int:
    """The transient of a quantized base, per device: dequantized weights that exist while a layer runs.

    ``QuantizedLinear`` dequantizes when the layer runs (forward, recomputed forward, backward) as a
    value tied to the layer's input, so XLA can neither hoist it to the start of the step nor share
    it between passes; with several devices each shard is dequantized and all-gathered in the
    compute dtype. A projection's whole weight thus exists in full precision only while it is used:
    about ``DEQUANTIZED_PROJECTIONS`` of the largest at the peak, beyond what an unquantized base
    keeps there (its gathered weights). Calibrated on the CPU compiler (docs/memory.md).
    """
    if not quantized(st):
        return 0
    return DEQUANTIZED_PROJECTIONS * max(o * i for o, i in linears(s).values()) * DTYPE_BYTES[st.dtype]


def logits_bytes(s: Shape, st: Setting) -> int:
    """The loss's buffers per device.

    The model's own head builds [tokens, vocab] logits, upcast to fp32 for the loss, and their
    gradient: three fp32 copies. The chunked loss (``train.chunked_loss``) holds those for one
    block of positions at a time (``config.rules.loss_block``). TRL's fused head (``train.fused_lm_head``) scores
    at most 4096 tokens (over all devices) against 32768-wide vocabulary tiles at a time.
    """
    if st.chunked_loss:
        return 3 * st.live_sequences * loss_block(st.length) * s.vocab * 4
    if not st.fused_head:
        return 3 * st.tokens * s.vocab * 4
    rows = math.ceil(min(st.live_sequences * st.devices * (st.length - 1), 4096) / st.devices)
    return 3 * rows * min(max(s.vocab, 32768), 32768) * 4


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
    workspace: int  # the LM head gathered whole for the logits (FSDP, more than one device); TPU: and a layer
    gradient_phase: int  # gradients at the end of the backward pass (CPU: all-reduced whole, not sharded)
    dequantized: int  # a quantized base's transient (CPU: dequantized weights; TPU: its layers' extra activations)
    peak: int
    margin: int
    capacity: int  # memory per device

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
           + full fine-tuning's gradient copies + a quantized base's dequantized weights + dropout's bits
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
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=t.kept + dropout,
        activations_checkpointed=t.kept_checkpointed + dropout_masks(s, replace(st, checkpointing=True), "tpu"),
        activations_not_checkpointed=t.kept_not_checkpointed
        + dropout_masks(s, replace(st, checkpointing=False), "tpu"),
        dropout_masks=dropout,
        logits=t.logits,
        workspace=t.gathered,
        gradient_phase=gradients + t.gradients,
        dequantized=t.dequantized,
        peak=peak,
        margin=margin_for(peak),
        capacity=capacity,
    )
