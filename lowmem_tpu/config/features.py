"""What a model's config defines that an attention kernel or a loss must honour.

Read off a transformers config or a config.json read as plain attributes (the planner's), so the
model builder, ``validate``, the planner and its advisor decide alike. Imports nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal config's ``text_config``, a dict when read as JSON)."""
    text = getattr(config, "text_config", None)
    if text is None:
        return config
    if isinstance(text, dict):
        return SimpleNamespace(**text)
    return text


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


def attention_features(config: Any) -> list[str]:
    """What the model's attention does beyond causal softmax attention, in words (empty: nothing)."""
    text = text_config(config)
    features = []
    window = sliding_window(config)
    if window:
        features.append(f"sliding windows of {window} keys")
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        features.append(f"attention scores soft-capped at {cap:g}")
    return features


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


def flash_refusal(config: Any) -> str | None:
    """Why ``model.attn_implementation: flash`` cannot compute this model's attention, or None.

    torch_xla 2.9's Pallas ``flash_attention`` takes causal masking, segment ids and an additive bias
    ``ab`` only (experimental/custom_kernel.py): no window and no soft-cap.
    """
    features = attention_features(config)
    if not features:
        return None
    return (
        f"model.attn_implementation: flash (torch_xla's Pallas kernel) has no {' or '.join(features)}, which "
        f"{getattr(text_config(config), 'model_type', 'this model')} defines; use chunked "
        "(the same memory saving, computing the model's own attention) or eager"
    )
