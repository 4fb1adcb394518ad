"""The planner's CPU layout: what XLA:CPU keeps live beside the persistent state, per device.

Calibrated against the CPU compiler (docs/memory.md, "How each figure is computed"); the TPU's is
:mod:`lowmem_tpu.memory.tpu_layout`. ``dropout_masks`` and a quantized base's helpers serve both.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lowmem_tpu.config.rules import loss_block
from lowmem_tpu.memory.shape import Setting, Shape, linears

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


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
