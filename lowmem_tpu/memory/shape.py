"""What a plan is made of: the architecture's shape and the recipe's memory-relevant settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.features import (
    SINKS,
    TOWERS,
    Attention,
    Experts,
    attention_of,
    chunked_loss_refusal,
    experts_of,
    layers_differ,
    text_config,
)
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.config.model_fields import LORA_TARGETS, QUANT_BITS
from lowmem_tpu.config.rules import batch_split_problem
from lowmem_tpu.config.schema import uses_master_weights
from lowmem_tpu.errors import UserError


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a decoder-only (Llama-family) architecture."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    # windows, soft-capped scores: what flash or packed masks rule out
    attention: Attention = field(default_factory=Attention)
    chunked_loss_refusal: str | None = None  # why the chunked loss cannot compute this model's logits
    # Where layers differ (Gemma 4): each layer's projections, and the weights outside them and outside the
    # embedding, the LM head and two norms per layer (per-layer embeddings, Gemma's extra norms).
    layer_linears: tuple[dict[str, tuple[int, int]], ...] = ()
    other_weights: tuple[tuple[int, ...], ...] = ()
    towers: int = 0  # parameters outside the text decoder (a multimodal checkpoint's vision and audio towers)
    capped_logits: bool = False  # final_logit_softcapping: tanh(logits / cap) * cap before the loss
    experts: Experts | None = None  # a MoE decoder's routed experts (their stacks are among layer_linears)


def shape_of(config: Any) -> Shape:
    """The planner's view of a transformers config (Llama, Mistral, Qwen2 and others of that layout)."""
    outer, config = config, text_config(config)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers") if not hasattr(config, k)]
    if missing:
        kind = getattr(config, "model_type", type(config).__name__)
        raise UserError(
            f"model.name_or_path: a {kind} config has no {', '.join(missing)}; the planner needs a Llama-like model"
        )
    capped = bool(getattr(config, "final_logit_softcapping", None))
    # a multimodal checkpoint's towers, counted by the caller that read the config (model.build.require_config)
    extra = {"towers": getattr(outer, TOWERS, 0), "capped_logits": capped}
    if layers_differ(config):
        return replace(_per_layer_shape(outer, config), **extra)
    heads = config.num_attention_heads
    shape = Shape(
        **extra,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", getattr(outer, "tie_word_embeddings", False))),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        attention=attention_of(outer),
        chunked_loss_refusal=chunked_loss_refusal(outer),
    )
    if getattr(config, "model_type", None) in QK_NORMED:
        shape = replace(shape, other_weights=((shape.head_dim,),) * (2 * shape.layers))
    if getattr(config, "model_type", None) in SINKS:  # a learned sink per head, every layer
        shape = replace(shape, other_weights=shape.other_weights + ((heads,),) * shape.layers)
    experts = experts_of(config)
    biased = getattr(config, "model_type", None) in BIASED_EXPERTS
    return shape if experts is None else _with_experts(shape, experts, biased)


QK_NORMED = ("qwen3", "qwen3_moe")  # a norm of head_dim weights on queries and keys in every layer
BIASED_EXPERTS = ("gpt_oss",)  # a bias per expert and projection output, and on the router


# A layer's stacked experts among its projections, as (out, in) of the stack seen as one matrix: what is
# stored and gathered. LoRA on a stack has a rank per expert (PEFT: lora_A [rank x experts, in]).
EXPERT_STACKS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}


def _with_experts(shape: Shape, experts: Experts, biased: bool = False) -> Shape:
    """A MoE decoder's layers one by one: its MoE layers' stacked experts (and routers, among the other weights)
    in place of the dense MLP, which the rest keep. A layer's MLP activations are its routed rows' (top-k
    experts wide): ``intermediate`` is their width."""
    h, e, inner = shape.hidden, experts.count, experts.inner
    dense = linears(shape)
    attention = {name: dense[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    stacks = {"experts.gate_up_proj": (e * 2 * inner, h), "experts.down_proj": (e * h, inner)}
    layers = tuple(
        attention | (stacks if i in experts.layers else {k: dense[k] for k in dense if k not in attention})
        for i in range(shape.layers)
    )
    routers = tuple((e, h) for _ in experts.layers)
    if biased:
        routers += tuple(shape for _ in experts.layers for shape in ((e, 2 * inner), (e, h), (e,)))
    width = max(experts.per_token * inner, shape.intermediate if len(experts.layers) < shape.layers else 0)
    return replace(
        shape, layer_linears=layers, other_weights=shape.other_weights + routers, intermediate=width, experts=experts
    )


def _per_layer_shape(outer: Any, config: Any) -> Shape:
    """Gemma 4's layers as transformers builds them (``per_layer_config``, ``kv_sharing_modes``): full layers'
    wider heads (and with ``attention_k_eq_v`` their own KV heads and no v_proj), no k/v projections on the
    layers that reuse earlier ones' K/V (their MLP twice as wide with ``use_double_wide_mlp``), per-layer
    embeddings (PLE), and in 26B-A4B routed experts beside each dense MLP. The scalar fields are the widest
    layer's: what one layer's activations can take."""
    h, heads, n = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    modes = getattr(config, "kv_sharing_modes", None) or [None] * n
    ple = getattr(config, "hidden_size_per_layer_input", 0) or 0
    experts = experts_of(config) if getattr(config, "enable_moe_block", False) else None
    layers, other = [], []
    for i in range(n):
        layer = config.per_layer_config[i]
        q, kv = heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
        full = config.layer_types[i] == "full_attention"
        wide = 2 if getattr(config, "use_double_wide_mlp", False) and modes[i] == "reuse" else 1
        inner = layer.intermediate_size * wide
        projections = {"q_proj": (q, h)}
        if modes[i] != "reuse":
            projections["k_proj"] = (kv, h)
            if not (getattr(config, "attention_k_eq_v", False) and full):
                projections["v_proj"] = (kv, h)
            other += [(layer.head_dim,)]  # k_norm (v_norm has no weight)
        projections |= {"o_proj": (h, q), "gate_proj": (inner, h), "up_proj": (inner, h), "down_proj": (h, inner)}
        if ple:
            projections |= {"per_layer_input_gate": (ple, h), "per_layer_projection": (h, ple)}
            other += [(h,)]  # post_per_layer_input_norm
        if experts is not None:  # 26B-A4B: experts beside the dense MLP, and their router
            e, routed = experts.count, experts.inner
            projections |= {"experts.gate_up_proj": (e * 2 * routed, h), "experts.down_proj": (e * h, routed)}
            other += [(e, h), (h,), (e,), (h,), (h,), (h,)]  # router proj, scale, per-expert scale; 3 norms
        other += [(layer.head_dim,), (h,), (h,)]  # q_norm, pre- and post-feedforward norms
        layers.append(projections)
    if ple:
        vocab = getattr(config, "vocab_size_per_layer_input", None) or config.vocab_size
        other += [(vocab, n * ple), (n * ple, h), (ple,)]  # the table, its model projection and norm
    widest = max(layers, key=lambda p: sum(o * i for o, i in p.values()))
    head_dim = max(config.per_layer_config[i].head_dim for i in range(n))
    return Shape(
        hidden=h,
        intermediate=widest["gate_proj"][0] + (experts.per_token * experts.inner if experts else 0),
        layers=n,
        heads=heads,
        kv_heads=max(config.per_layer_config[i].num_key_value_heads for i in range(n)),
        head_dim=head_dim,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", getattr(outer, "tie_word_embeddings", False))),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        attention=attention_of(outer),
        chunked_loss_refusal=chunked_loss_refusal(outer),
        layer_linears=tuple(layers),
        other_weights=tuple(other),
        experts=experts,
    )


def linears(s: Shape) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one decoder layer (where layers differ, the widest)."""
    if s.layer_linears:
        return max(s.layer_linears, key=lambda p: sum(o * i for o, i in p.values()))
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "q_proj": (q, s.hidden),
        "k_proj": (kv, s.hidden),
        "v_proj": (kv, s.hidden),
        "o_proj": (s.hidden, q),
        "gate_proj": (s.intermediate, s.hidden),
        "up_proj": (s.intermediate, s.hidden),
        "down_proj": (s.hidden, s.intermediate),
    }


# ----------------------------------------------------------------------------- what the plan varies


@dataclass(frozen=True)
class Setting:
    """The recipe fields that memory depends on, on one device count."""

    lora: bool
    rank: int
    targets: tuple[str, ...]
    lora_dropout: float
    dtype: str
    strategy: str
    checkpointing: bool
    global_batch: int
    accumulation: int
    length: int
    optimizer: str
    fused_head: bool
    devices: int
    quantize: str = "none"  # the frozen base's decoder linears: none, int8, int4 or nf4 (LoRA only)
    all_linear: bool = False  # lora.target_modules: all-linear adapts every projection (Gemma 4's PLE ones too)
    group_size: int = 64  # int4: inputs sharing one scale; nf4: the block of one maximum
    double_quant: bool = False  # nf4: block maxima in 8 bits (+ an fp32 scale per 256 of them)
    quantize_lm_head: bool = False
    master_weights: bool = False  # fp32 copies of the low-precision trainable weights (train.master_weights)
    adapter_dtype: str = "float32"  # lora.dtype: the adapters in the base's dtype ("model") or fp32
    attention: str = "eager"  # model.attn_implementation: eager/sdpa keep [length, length] scores, chunked/flash not
    checkpoint_every: int = 1  # with checkpointing: one decoder layer in this many is recomputed
    chunked_loss: bool = False  # train.chunked_loss: the loss over blocks of positions, no whole logits
    method: str = "sft"  # recipe.method (config.methods): a preference step holds both rows of each pair
    precompute_reference: bool | None = None  # preference.precompute_ref_log_probs (None: when not LoRA)

    @property
    def bits(self) -> int:
        """Bits per quantized weight (0: not quantized)."""
        return QUANT_BITS.get(self.quantize, 0)

    @property
    def preference(self) -> bool:
        """A preference method's step (TRL's LM head; global_batch counts rows: a pair is two)."""
        return METHODS[self.method].preference

    @property
    def reference_precomputed(self) -> bool:
        return not self.lora if self.precompute_reference is None else self.precompute_reference

    @property
    def reference_pass(self) -> bool:
        """Whether each step runs a reference's forward pass (DPO's, KTO's; not when precomputed)."""
        return METHODS[self.method].reference and not self.reference_precomputed

    @property
    def kl_passes(self) -> int:
        """Of the forward passes, those over KTO's KL rows (the policy's and the reference's, no gradients)."""
        return METHODS[self.method].kl_passes

    @property
    def forward_passes(self) -> int:
        """Forward passes over the micro-batch's rows in a step (the reference's and KTO's KL rows included)."""
        return METHODS[self.method].forward_passes(self.reference_precomputed)

    @property
    def sequences(self) -> int:
        """Sequences each device holds in one forward pass (micro-batch / devices)."""
        return self.global_batch // self.accumulation // self.devices

    @property
    def live_sequences(self) -> int:
        """Sequences whose activations can be live at once on a device: one micro-batch's (the trainer
        cuts the graph after each micro-batch's backward pass)."""
        return self.sequences

    @property
    def tokens(self) -> int:
        """Tokens per device whose activations can be live at once."""
        return self.live_sequences * self.length


def setting_of(recipe: Recipe, devices: int) -> Setting:
    """The memory-relevant part of a recipe, on ``devices`` XLA devices."""
    t, lora = recipe.train, recipe.lora
    targets = LORA_TARGETS if lora.target_modules == "all-linear" else _unfused(lora.target_modules)
    setting = Setting(
        lora=lora.enabled,
        rank=lora.r,
        targets=targets,
        all_linear=lora.target_modules == "all-linear",
        lora_dropout=lora.dropout,
        dtype=recipe.model.dtype,
        strategy=recipe.sharding.strategy,
        checkpointing=recipe.sharding.checkpoint_every > 0,
        checkpoint_every=max(recipe.sharding.checkpoint_every, 1),
        chunked_loss=t.chunked_loss,
        # a preference method: both rows of every pair through the policy; DPO's reference pass needs no grad
        # and frees each layer's activations as it goes
        global_batch=t.global_batch_size * METHODS[recipe.method].rows_per_example,
        accumulation=t.gradient_accumulation_steps,
        length=recipe.data.max_length,
        optimizer=t.optimizer,
        fused_head=getattr(t, "fused_lm_head", False),
        devices=devices,
        quantize=getattr(recipe.model, "quantize", "none"),
        group_size=getattr(recipe.model, "quantize_group_size", 64),
        double_quant=recipe.model.quantize == "nf4" and recipe.model.quantize_double is not False,
        quantize_lm_head=getattr(recipe.model, "quantize_lm_head", False),
        master_weights=uses_master_weights(recipe),
        adapter_dtype=recipe.model.dtype if lora.dtype == "model" else "float32",
        attention=getattr(recipe.model, "attn_implementation", "eager"),
        method=recipe.method,
        precompute_reference=recipe.preference.precompute_ref_log_probs,
    )
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, devices)
    if problem:
        raise UserError(problem)
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if lora.enabled and unknown:
        raise UserError(f"lora.target_modules: the planner knows {', '.join(LORA_TARGETS)}; not {', '.join(unknown)}")
    return setting


# Phi's fused projections, planned as the projections they fuse (the same weights; one LoRA A instead of
# two or three, a few rank-sized rows the plan counts more).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _unfused(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(part for name in names for part in FUSED.get(name, (name,))))
