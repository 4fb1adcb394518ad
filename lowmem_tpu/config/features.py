"""What a model's config defines that an attention kernel or a loss must honour.

Read off a transformers config or a config.json read as plain attributes (the planner's), so the
model builder, ``validate``, the planner and its advisor decide alike. Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# Set on a multimodal config by model.build.require_config: its vision and audio towers' parameters, which the
# planner (memory.shape) counts as frozen weights beside a text step.
TOWERS = "lowmem_tower_parameters"


def text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal config's ``text_config``, a dict when read as JSON)."""
    text = getattr(config, "text_config", None)
    if text is None:
        return config
    if isinstance(text, dict):
        return SimpleNamespace(**text)
    return text


def layers_differ(config: Any) -> bool:
    """Whether the text decoder's layers differ in shape (Gemma 4: per-layer head sizes, layers that reuse others'
    K/V, per-layer embeddings): transformers' heterogeneous configs, and any config that shares K/V."""
    text = text_config(config)
    return bool(
        getattr(text, "is_heterogeneous", False)
        or getattr(text, "num_kv_shared_layers", 0)
        or getattr(text, "hidden_size_per_layer_input", 0)
    )


def sliding_window(config: Any) -> int | None:
    """Keys a query of a windowed layer sees (itself included), or None when no layer is windowed.

    Qwen 2.5 lists a window with ``use_sliding_window: false``; a config with ``layer_types`` windows
    only its ``sliding_attention`` layers (Gemma 2/3); Mistral and Phi-3 window every layer.
    """
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


@dataclass(frozen=True)
class Attention:
    """What a model's attention does beyond causal softmax attention, and what that rules out.

    A window of ``window`` keys hides a key only from a query ``window`` or more positions later
    (transformers' sliding-window mask: ``q - k < window``), so rows of ``length <= window`` tokens
    never meet it: at that length the model's attention is plain causal attention.
    """

    model_type: str = "this model"
    window: int | None = None
    softcap: float | None = None
    routed: bool = False  # a MoE model: transformers' load-balancing loss reads the mask as [batch, length]
    sinks: bool = False  # gpt-oss: a learned score per head joins each row's softmax (``module.sinks``)

    def features(self, length: int) -> list[str]:
        """What rows of ``length`` tokens meet beyond causal attention, in words (empty: nothing)."""
        features = []
        if self.window is not None and self.window < length:
            features.append(f"sliding windows of {self.window} keys (rows of {length} tokens)")
        if self.softcap:
            features.append(f"attention scores soft-capped at {self.softcap:g}")
        if self.sinks:
            features.append("attention sinks")
        return features

    def flash_refusal(self, length: int) -> str | None:
        """Why ``model.attn_implementation: flash`` cannot compute this attention on rows of ``length``, or None.

        torch_xla 2.9's Pallas ``flash_attention`` takes causal masking, segment ids and an additive bias
        ``ab`` only (experimental/custom_kernel.py): no window and no soft-cap.
        """
        features = self.features(length)
        if not features:
            return None
        return (
            f"model.attn_implementation: flash (torch_xla's Pallas kernel) has no {' or '.join(features)}, which "
            f"{self.model_type} defines; use chunked (the same memory saving, computing the model's own attention) "
            "or eager"
        )

    def packed_mask_refusal(self, length: int) -> str | None:
        """Why eager/sdpa attention cannot take packed rows of ``length`` tokens, or None: packed rows reach
        them as one [length, length] mask (``model.attention.packed_mask``), which transformers uses as given,
        in place of the window it would build, and which a MoE model's load-balancing loss cannot read."""
        if self.routed:
            return (
                f"data.packing: packed rows reach eager/sdpa attention as one [length, length] mask, and "
                f"{self.model_type}'s load-balancing loss reads the mask as [batch, length]; use "
                "model.attn_implementation: chunked (or flash on a TPU), or data.packing: false"
            )
        if self.window is None or self.window >= length:
            return None
        return (
            f"data.packing: packed rows reach eager/sdpa attention as one mask in place of {self.model_type}'s "
            f"sliding window of {self.window} keys, which rows of {length} tokens meet; use "
            "model.attn_implementation: chunked (packed rows and windows both), or data.packing: false"
        )

    def refusal(self, implementation: str, packing: bool, length: int) -> str | None:
        """Why ``model.attn_implementation: implementation`` on rows of ``length`` (packed or not) does not
        compute this attention, or None."""
        if implementation == "flash":
            return self.flash_refusal(length)
        if implementation == "sdpa" and self.sinks:  # transformers' own sdpa drops them: it refuses the model
            return (
                f"model.attn_implementation: sdpa has no attention sinks, which {self.model_type} defines; use "
                "chunked (the memory saving of flash, computing the sinks) or eager"
            )
        if packing and implementation in ("eager", "sdpa"):
            return self.packed_mask_refusal(length)
        return None


SINKS = ("gpt_oss",)  # model types whose attention has a learned sink per head


def attention_of(config: Any) -> Attention:
    """The attention a transformers config (or a config.json read as attributes) defines."""
    text = text_config(config)
    return Attention(
        model_type=getattr(text, "model_type", None) or "this model",
        window=sliding_window(config),
        softcap=getattr(text, "attn_logit_softcapping", None) or None,
        routed=experts_of(config) is not None,
        sinks=getattr(text, "model_type", None) in SINKS,
    )


def chunked_loss_refusal(config: Any) -> str | None:
    """Why ``train.chunked_loss`` cannot compute this model's loss, or None: it takes the head's plain
    logits, while Gemma 2 soft-caps them (``final_logit_softcapping``) and Cohere scales them."""
    text = text_config(config)
    if not (getattr(text, "final_logit_softcapping", None) or getattr(text, "logit_scale", None)):
        return None
    return (
        f"train.chunked_loss: {getattr(text, 'model_type', 'this model')} scales or soft-caps its logits, which the "
        "chunked loss does not do; set train.chunked_loss: false"
    )


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts decoder: ``count`` experts of inner width ``inner`` in each of ``layers``, the
    router picking ``per_token`` of them for every token."""

    count: int
    per_token: int
    inner: int
    layers: tuple[int, ...]

    def parameters(self, hidden: int) -> int:
        """Every expert's weights and the routers, over the MoE layers (gate, up and down per expert)."""
        return len(self.layers) * self.count * (3 * self.inner * hidden + hidden)

    def idle(self, hidden: int) -> int:
        """The expert weights a token does not go through: total minus active parameters."""
        return len(self.layers) * (self.count - self.per_token) * 3 * self.inner * hidden


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen 3 MoE and Gemma 4, gpt-oss, DeepSeek
PER_TOKEN = ("num_experts_per_tok", "experts_per_token", "top_k_experts")


def experts_of(config: Any) -> Experts | None:
    """The model's experts, read as transformers' Qwen 3 MoE and gpt-oss configs give them (layers listed in
    ``mlp_only_layers``, or off ``decoder_sparse_step``, keep a dense MLP); None for a dense model."""
    config = text_config(config)
    count = next((getattr(config, key, None) for key in EXPERT_COUNTS if getattr(config, key, None)), 0)
    if count <= 0:
        return None
    per_token = next((getattr(config, key) for key in PER_TOKEN if getattr(config, key, None)), 1)
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    layers = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return Experts(count, per_token, inner, layers)


def quantize_refusal(config: Any, quantize: str) -> str | None:
    """Why ``model.quantize`` cannot quantize this model as it claims: its experts (most of a MoE model's
    weights) are stacked parameters that only a Linear's quantization would miss, leaving them in bf16."""
    experts = experts_of(config)
    if quantize == "none" or experts is None:
        return None
    return (
        f"model.quantize: {quantize} quantizes Linear layers, and this model keeps most of its weights in "
        f"{experts.count} stacked experts per layer, which would stay unquantized; set model.quantize: none "
        "(LoRA on the bf16 base)"
    )
