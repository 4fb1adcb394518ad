"""The planner's TPU layout: a step's memory per chip as libtpu's compiler lays it out.

Read off the TPU compiler's buffer assignments (``lowmem-tpu memory --compile``, libtpu 0.0.21 for
v5e; ``benchmarks/tpu_planner_grid.py``, docs/memory.md), which differ from XLA:CPU's in kind:

- everything kept for the backward pass is in the compute dtype (bf16), the softmax's
  probabilities too (the fp32 softmax is fused away);
- the loss is fused into the LM head: one [tokens, vocab] buffer in the compute dtype, no fp32
  copies; ``train.chunked_loss`` keeps two blocks' logits (mini, v5e-8: 96 MiB against 185 without
  it; it was 346 while its top-1 hits took an argmax, see ``model.loss``);
- chunked attention (``model.attn_implementation: chunked``, plain PyTorch) keeps every block of
  keys' fp32 scores at once in the layer in hand: more than eager attention; ``flash`` is the lever;
- under FSDP the compiler gathers the smaller operand of each projection: the weights while the
  program's tokens outnumber the projection's width (Open Llama 3B, 32 x 1024 tokens), else the
  activations (the 70B's width 8192 over 8 x 512 tokens: all-to-alls and [8, 512, 8192] gathers);
- a checkpointed decoder layer keeps ``KEPT_PER_LAYER`` hidden-sized tensors per token (the slope
  over the layers: Open Llama 3B, 2.0 under FSDP over 8 chips, 3.9 on one chip; Llama 2 70B's width
  in bf16, activations gathered, 3.3);
- a layer that is not checkpointed keeps ``KEPT_HIDDEN`` and ``KEPT_INTERMEDIATE`` per token (more hidden-sized
  ones when a micro-batch has several rows per chip), flash's query, keys, values and output at the padded head
  (eager: part of its probabilities, and soft-capped scores' tanh) and, for LoRA under FSDP across chips, a
  copy of its weights' shards;
- the layer being recomputed holds its activations, its probabilities, the MLP's gradients in
  fp32 (two [tokens, intermediate] across chips, three on one) and, under FSDP over several
  chips, its gathered weights and the gathered head;
- an int8 base under FSDP keeps more per layer than a bf16 base: with the weights gathered, the outputs
  of its windowed einsums (``AllocateBuffer``), with the activations gathered its fp32 dequantized shards;
  an int4 base in ``model.nibbles``' layout nothing more with the weights gathered, and on one chip nothing
  more than bf16 (``QUANTIZED_KEPT_PER_LAYER``);
- full fine-tuning keeps every layer's gradient and more than an fp32 copy of it until the
  optimizer runs (the same 4 -> 26 layer slope).

Every buffer sits in one arena whose span, not the bytes live at one moment, is what the chip
must hold, so the counts here are of the arena. Shards are padded to the chip's tiles
(:mod:`lowmem_tpu.memory.tiles`). Small models are planned poorly, either way: the compiler then
keeps mid-sized buffers in the chip's on-chip memory, which is not HBM, and its fixed costs dominate.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_tpu.config.rules import loss_block
from lowmem_tpu.memory.cpu_layout import DTYPE_BYTES, quantized
from lowmem_tpu.memory.shape import Setting, Shape, linears

# Hidden-sized tensors per token a checkpointed layer keeps (libtpu 0.0.21): Open Llama 3B's LoRA step at
# 2 and 4 layers over 8 chips (weights gathered: 1.98, benchmarks/tpu_layer_slopes.py; it was 2.59 while the
# step traced was the warm-up's first, at learning rate 0) and on one chip (3.93; 5.0 in the first-step
# form; the 7B at 2 x 1024 tokens: 3.41), Llama 2 70B's width at 2 and 4 layers in bf16 (8 x 512 tokens
# over 8 chips: the activations gathered).
KEPT_PER_LAYER = {"weights gathered": 2.0, "activations gathered": 3.3, "one chip": 3.9}
# Per token of the layer in hand: hidden-sized and intermediate-sized tensors in the compute dtype
# (Open Llama 3B at 4 layers), and the MLP's fp32 gradients, intermediate-sized: two live at the
# peak across chips, three on one (the buffers live at the compiler's peak, 8 chips and 1).
RECOMPUTED_HIDDEN, RECOMPUTED_INTERMEDIATE = 9, 1
MLP_GRADIENTS_FP32 = {"sharded": 2, "one chip": 3}
# A layer that is not checkpointed keeps these per token beside its attention's (``attention_kept``) and, under
# FSDP, its weights' copy (``weight_copy``): hidden-sized and intermediate-sized tensors in the compute dtype,
# and more hidden-sized ones where a micro-batch has several rows per chip. Read off the slopes between 2 and 4
# layers at real width (benchmarks/tpu_layer_slopes.py, the ``none-*`` rows of
# benchmarks/results/tpu_layer_slopes.json): Open Llama 3B on v5e-1 at 1, 2 and 4 rows (flash 19.1, 23.6, 23.6
# hidden-sized per token; eager 22.4 and 27.2 at 1 and 2), on v5e-8 at 2 rows (flash 26.4, eager 29.5), Llama
# 3.1 8B on v5e-8 at 1 and 2 rows (flash 28.6, 24.0: at 1 row 4.0 of it are windowed einsums' outputs, and 2
# rows keep no more, so its 2-row steps plan up to 17% over).
KEPT_HIDDEN, KEPT_INTERMEDIATE = 6, 3
SEVERAL_ROWS_KEPT_HIDDEN = 4.5
# Bytes per trained element held until the optimizer runs, beyond its gradient in the compute dtype:
# an fp32 copy and part of the update (full fine-tuning with fp32 master weights and Adafactor: the
# 4 -> 26 layer slope of Open Llama 3B on v5e-8 gives 6.9, the 7B on v5e-16 about 4; 5 is between).
GRADIENT_COPY_BYTES = 5


@dataclass(frozen=True)
class TpuTransients:
    """Bytes per chip beside the persistent state: what the planner's peak adds to it."""

    kept: int  # the forward pass's activations kept for the backward pass (with the setting's checkpointing)
    kept_checkpointed: int
    kept_not_checkpointed: int
    layer: int  # the layer in hand: recomputed activations, probabilities, the MLP's fp32 gradients
    logits: int
    gathered: int  # FSDP over several chips: the head and one layer's weights gathered whole
    code: int  # a MoE model's grouped-matmul kernels' programs
    gradients: int  # full fine-tuning: every layer's gradient copies held for the optimizer
    dequantized: int

    freed_before_recompute: int = 0  # every_K: the later layers' activations, gone when the first is recomputed
    workspace: int = 0  # a layer's gradient buffers alone (a layer not checkpointed needs nothing recomputed)

    @property
    def peak(self) -> int:
        # The head's backward comes first: no layer's gradient exists yet when the loss's buffers are live.
        loss_phase = self.kept + self.logits
        layer_phase = max(self.kept - self.freed_before_recompute + self.layer, self.kept + self.workspace)
        return max(loss_phase, layer_phase + self.gradients) + self.gathered + self.code + self.dequantized


# A step unlike those the layout is read off keeps more than planned: up to 81% more (Open Llama 3B's LoRA step
# on v5e-8 recomputing every layer over 2 micro-batches of 2 rows; benchmarks/replan_searches.py: the searches'
# other such candidates, one layer in 2 recomputed, or in 4 where cut at 4 and 8 layers, eager with
# nothing recomputed, full fine-tuning, up to 25%; every_4 rows cut at 2 and 4 layers overstate the compiler).
UNCALIBRATED_MORE = 0.81


def calibrated(st: Setting) -> bool:
    """Whether the layout was read off steps like this one: every decoder layer recomputed, and (over several
    chips) one micro-batch per step (one chip: the QLoRA recipes' 2 micro-batches are within 10%); or a LoRA
    step on a bf16 base with flash and no layer recomputed, any micro-batches (the ``none-flash`` slopes)."""
    every_layer = st.checkpointing and st.checkpoint_every == 1 and (st.accumulation == 1 or st.devices == 1)
    none = not st.checkpointing and st.lora and not quantized(st) and st.attention == "flash"
    return bool(every_layer or none)


def _spread(st: Setting) -> str:
    return "sharded" if st.devices > 1 and st.strategy == "fsdp" else "one chip"


def _gathering(s: Shape, st: Setting) -> str:
    """What the compiler gathers for a projection under FSDP: the smaller of its weight ([width, hidden])
    and the activations of every chip ([tokens, hidden]); on one chip nothing."""
    if _spread(st) == "one chip":
        return "one chip"
    program_tokens = st.tokens * st.devices
    return "weights gathered" if s.heads * s.head_dim < program_tokens else "activations gathered"


# Chunked attention (plain PyTorch) in the layer in hand on a TPU: fp32 [sequences, heads, length, 128]
# blocks for every block of keys at once, counted in fp32 [length, length] score sets per sequence and
# head: Open Llama 3B's width at 4 layers, 4 x 1024 tokens per chip, the steady step: 535 MiB above eager
# attention on v5e-8 (1.5 sets, eager's bf16 probabilities given back), 262 MiB on v5e-1 (1.0).
CHUNKED_ATTENTION_FP32_SCORES = {"sharded": 1.5, "one chip": 1.0}


def probabilities(s: Shape, st: Setting) -> int:
    """The softmax's probabilities of one layer: [sequences, heads, length, keys] in the compute dtype for
    eager/sdpa, one block of 128 keys for flash; chunked attention's blocks, all of them in fp32."""
    scores = st.live_sequences * s.heads * st.length
    if st.attention == "flash":
        return scores * min(128, st.length) * DTYPE_BYTES[st.dtype]
    if st.attention == "chunked":
        return int(scores * st.length * 4 * CHUNKED_ATTENTION_FP32_SCORES[_spread(st)])
    return scores * st.length * DTYPE_BYTES[st.dtype]


# Flash keeps what torch_xla's kernel saves for its backward pass: its query, keys and values in the kernel's
# layout (the head padded to the 128 lanes, keys and values repeated for every query head) and its output
# (``bf16[2, 32, 1024, 128]`` four times a layer among the buffers live at the peak, Open Llama 3B on v5e-8).
# Eager attention keeps 3.3-3.6 hidden-sized per token more than flash at Open Llama 3B's width (1 and 2 rows,
# v5e-1): 0.83 of its bf16 probabilities (10.2). The planner counts 0.7: eager's layers then plan 5-6% under
# the slopes, and the grid's 4-layer eager steps (benchmarks/results/tpu_planner_grid.json) stay within 10%.
FLASH_KEPT = 4
EAGER_PROBABILITIES_KEPT = 0.7
# Soft-capped scores (Gemma 2: ``tanh(scores / cap) * cap`` before the softmax) keep the tanh's output for its
# backward pass too: one more [heads, length, length] set per sequence (Gemma 2 9B at 2 and 4 layers on v5e-8,
# 1 row, eager: two bf16[16, 1024, 1024] a layer among the buffers live at the peak; the layer still plans 17%
# under its slope, which also holds the windowed einsums' outputs of one row per chip).
SOFT_CAPPED_SCORES_KEPT = 1.0


def attention_kept(s: Shape, st: Setting) -> int:
    """What a layer's attention keeps for its backward pass: the kernel's inputs and output (flash), part of
    the softmax's probabilities (eager), or (sdpa, chunked) the probabilities' buffers."""
    if st.attention == "flash":
        lanes = -(-s.head_dim // 128) * 128
        return FLASH_KEPT * st.tokens * s.heads * lanes * DTYPE_BYTES[st.dtype]
    if st.attention == "eager":
        capped = SOFT_CAPPED_SCORES_KEPT if s.attention.softcap else 0
        return int((EAGER_PROBABILITIES_KEPT + capped) * probabilities(s, st))
    return probabilities(s, st)


def weight_copy(s: Shape, st: Setting) -> int:
    """Under FSDP across chips a LoRA layer that is not recomputed keeps a copy of its frozen weights' shards
    from its forward pass to its backward pass (Open Llama 3B at 2 and 4 layers on v5e-8, flash and eager: each
    projection's shard twice among the buffers live at the peak, once as the argument)."""
    if _spread(st) == "one chip" or quantized(st) or not st.lora:
        return 0
    return sum(o * i for o, i in linears(s).values()) * DTYPE_BYTES[st.dtype] // st.devices


def layer_kept(s: Shape, st: Setting) -> int:
    """What a layer that is not checkpointed keeps for its backward pass."""
    e = DTYPE_BYTES[st.dtype]
    hidden = KEPT_HIDDEN + (SEVERAL_ROWS_KEPT_HIDDEN if st.live_sequences > 1 else 0)
    activations = int(st.tokens * (hidden * s.hidden + KEPT_INTERMEDIATE * s.intermediate) * e)
    return activations + attention_kept(s, st) + weight_copy(s, st)


def kept(s: Shape, st: Setting, checkpointing: bool) -> int:
    """The forward pass's activations at the start of the backward pass."""
    if not checkpointing:
        return s.layers * layer_kept(s, st)
    recomputed = -(-s.layers // st.checkpoint_every)
    per = KEPT_PER_LAYER[_gathering(s, st)]
    hidden = st.tokens * s.hidden * DTYPE_BYTES[st.dtype]
    return int(recomputed * per * hidden) + (s.layers - recomputed) * layer_kept(s, st)


def backward_workspace(s: Shape, st: Setting) -> int:
    """A layer's gradient buffers: the MLP's in fp32 and the probabilities'."""
    mlp = MLP_GRADIENTS_FP32[_spread(st)]
    return mlp * st.tokens * s.intermediate * 4 + probabilities(s, st)


def layer_in_hand(s: Shape, st: Setting) -> int:
    """The layer whose backward pass runs: its recomputed activations (checkpointed) and its gradient buffers."""
    e = DTYPE_BYTES[st.dtype]
    recomputed = st.tokens * (RECOMPUTED_HIDDEN * s.hidden + RECOMPUTED_INTERMEDIATE * s.intermediate) * e
    return (recomputed if st.checkpointing else 0) + backward_workspace(s, st)


def freed_before_recompute(s: Shape, st: Setting) -> int:
    """Checkpointing one layer in K (layers 0, K, 2K, ...): the layers after the last checkpointed one run
    their backward pass first and free what they kept before any recomputation starts."""
    if not st.checkpointing:
        return 0
    last = st.checkpoint_every * (-(-s.layers // st.checkpoint_every) - 1)
    return (s.layers - 1 - last) * layer_kept(s, st)


# Hidden-sized tensors per token a quantized base keeps in every decoder layer beyond a bf16 base's
# (libtpu 0.0.21, the slope between 2 and 4 layers): int4 with the weights gathered none (``model.nibbles``'
# layout: Open Llama 3B on v5e-8 at 4 x 1024 tokens per chip, 1.87 hidden-sized a layer against bf16's 2.0,
# the ``q3b`` row); int8 5.3, read off int4's earlier layout (its windowed einsums' outputs), which plans
# int8's grid points within 10%; with the activations gathered, Llama 2 70B's width at 1 x 512 (1.8: fp32
# dequantized shards, int4's earlier layout); on one chip Open Llama 3B in int4 keeps less than in bf16
# (``q3b1``: 2.0 against 3.9), which a per-layer term does not take below bf16's: it plans high by that.
QUANTIZED_KEPT_PER_LAYER = {
    "int8": {"weights gathered": 5.3, "activations gathered": 1.8, "one chip": 0.0},
    "int4": {"weights gathered": 0.0, "activations gathered": 1.8, "one chip": 0.0},
}


# On one chip an int4 base's nibbles are unpacked and scaled in fp32, a projection at a time: the step's
# temporaries exceed a bf16 base's by 1.9 fp32 copies of the largest projection at Open Llama 3B's width
# (``model.nibbles``' layout, 4 layers, 4 x 1024 tokens: 203 MiB, benchmarks/results/tpu_planner_grid.json's
# w3b points on v5e-1). int8 (one scale per row) shows none.
INT4_ONE_CHIP_FP32_COPIES = 1.9


# Across chips an int4 projection is gathered packed and dequantized whole on every chip while its layer runs
# (the all-gather moves its bytes, not a bf16 weight): the step keeps that many fp32 copies of the largest
# projection beyond the per-layer term (libtpu 0.0.21, Llama 2 70B's shape on v5e-8 at 8 x 512 tokens, 2 and 4
# layers, packed bytes gathered: an fp32 [28672, 8192] product and two unpacked u8 copies live at the peak).
GATHERED_FP32_COPIES = 1.6

# NF4 (``model.nf4``'s TPU layout) is dequantized where it lies, the bf16 weight gathered: the step keeps one
# bf16 copy of the largest projection and nothing per layer beyond a bf16 base's (libtpu 0.0.21, Llama 2 70B's
# shape on v5e-8 at 16 x 512 tokens, 2 and 4 layers: 86 MiB a layer, under the bf16 plan's slope; the 2-layer
# step 0.32 GiB over the plan without a copy). On one chip the halves of a row are scaled in fp32 one at a
# time: one fp32 copy of the largest projection (Llama 3.1 8B at 4 x 1024 tokens, 2 and 4 layers).
NF4_GATHERED_BF16_COPIES = 1.0
NF4_ONE_CHIP_FP32_COPIES = 1.0


def dequantized(s: Shape, st: Setting) -> int:
    """What a quantized base keeps beyond a bf16 base's activations, per chip: every layer's extra buffers
    and the whole projection dequantized after its gather (across chips), or on one chip an int4/nf4
    base's fp32 dequantization of a projection; NF4 across chips, a gathered bf16 projection."""
    if not quantized(st):
        return 0
    largest = max(o * i for o, i in linears(s).values())
    one_chip = _gathering(s, st) == "one chip"
    if st.quantize == "nf4":
        return int(NF4_ONE_CHIP_FP32_COPIES * largest * 4 if one_chip else NF4_GATHERED_BF16_COPIES * largest * 2)
    if one_chip:
        return int(INT4_ONE_CHIP_FP32_COPIES * largest * 4) if st.quantize == "int4" else 0
    per = QUANTIZED_KEPT_PER_LAYER[st.quantize][_gathering(s, st)]
    return int(s.layers * per * st.tokens * s.hidden * DTYPE_BYTES[st.dtype] + GATHERED_FP32_COPIES * largest * 4)


# Blocks of logits ([sequences, block, vocab], compute dtype) the chunked loss holds at once.
CHUNKED_LOSS_BLOCKS = 2


# Full fine-tuning under FSDP trains the sharded head: the loss's fusion writes the logits' gradient beside
# the logits, and a transposed copy of it for the head's weight gradient then takes the logits' place
# (bf16 [4, 512, 32000] twice in mini's arena on v5e-8, [4, 1024, 32000] twice at Open Llama 3B's width;
# once with LoRA's frozen head, and once on one chip). Measured with the whole loss, not the chunked one.
TRAINED_HEAD_LOGITS = 2


# A preference step's [tokens, vocab] buffers per forward pass over its rows, in units of the SFT step's one:
# TRL's LM head for the policy (its fp32 log-probabilities kept for the backward pass), and for each pass more
# (DPO's reference; KTO's KL rows and reference). Read off the TPU compiler's figures for the shipped DPO
# recipes (two passes): 3.4 more than the SFT plan's one for Llama 3.1 8B on v5e-8, 2.8 more for Llama 3.2 3B
# on v5e-1 (docs/tpu_compile.json).
PREFERENCE_PASS_LOGITS = 2
# Soft-capped logits (``final_logit_softcapping``: Gemma 2, Gemma 4) keep two more [tokens, vocab] buffers for
# the backward (the tanh's output beside the capped logits the loss reads). Read off the TPU compiler's
# figures (docs/tpu_compile.json): Gemma 4 E2B on v5e-1 is planned 22% under without them (its towers
# uncounted too), Gemma 2 9B on v5e-8 6% under; with both, each within 10% (test_memory_plan).
SOFT_CAPPED_LOGITS_KEPT = 2
# KTO's passes over its KL rows add none: the TPU compiler's figure for llama3_8b_kto_v5e8 (2 rows a chip, four
# passes) is planned within 4% by its two passes over the rows alone, 26% over with all four counted.


def logits(s: Shape, st: Setting) -> int:
    """The loss's buffer: [tokens, vocab] in the compute dtype, or the chunked loss's blocks of it."""
    capped = SOFT_CAPPED_LOGITS_KEPT if s.capped_logits else 0
    if st.preference:
        buffers = PREFERENCE_PASS_LOGITS * (st.forward_passes - st.kl_passes)
        return (buffers + capped) * st.tokens * s.vocab * DTYPE_BYTES[st.dtype]
    rows = CHUNKED_LOSS_BLOCKS * st.live_sequences * loss_block(st.length) if st.chunked_loss else st.tokens
    copies = TRAINED_HEAD_LOGITS if not st.lora and not st.chunked_loss and _spread(st) == "sharded" else 1
    return (copies + capped) * rows * s.vocab * DTYPE_BYTES[st.dtype]


def gathered(s: Shape, st: Setting) -> int:
    """FSDP over several chips: the LM head and the layer in hand's weights, gathered whole (a
    quantized base's in its integers: it is dequantized after the gather). A quantized head is
    rebuilt whole on any number of chips."""
    e, sharded, base = DTYPE_BYTES[st.dtype], st.devices > 1 and st.strategy == "fsdp", quantized(st)
    head = s.vocab * s.hidden * e if sharded or (base and st.quantize_lm_head and not s.tied) else 0
    weights = sum(o * i for o, i in linears(s).values())
    layer = (weights * st.bits // 8 if base else weights * e) if sharded else 0
    return head + layer


# The programs of one MoE layer's grouped-matmul kernels (megablox's gmm and tgmm: forward, recomputation, the
# rows' and the stack's backward), in HBM with the step: the 2 -> 4 layer slope of generated code in
# docs/tpu_compile.json's qwen3_30b_a3b_lora_v5e8 record (51 MB a layer).
EXPERT_KERNEL_CODE = 51 * 2**20


def kernel_code(s: Shape) -> int:
    """A MoE model's grouped-matmul kernels' programs, one set per MoE layer."""
    return EXPERT_KERNEL_CODE * len(s.experts.layers) if s.experts else 0


def gradient_copies(s: Shape, st: Setting, trained_elements_per_chip: int) -> int:
    """Full fine-tuning: every trained element's gradient copy held until the optimizer's update."""
    return 0 if st.lora else trained_elements_per_chip * GRADIENT_COPY_BYTES


def transients(s: Shape, st: Setting, trained_elements_per_chip: int) -> TpuTransients:
    return TpuTransients(
        kept=kept(s, st, st.checkpointing),
        kept_checkpointed=kept(s, st, True),
        kept_not_checkpointed=kept(s, st, False),
        layer=layer_in_hand(s, st),
        freed_before_recompute=freed_before_recompute(s, st),
        workspace=backward_workspace(s, st),
        logits=logits(s, st),
        gathered=gathered(s, st),
        code=kernel_code(s),
        gradients=gradient_copies(s, st, trained_elements_per_chip),
        dequantized=dequantized(s, st),
    )
