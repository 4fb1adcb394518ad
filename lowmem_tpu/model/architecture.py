"""What the architecture is, without weights: checks, the decoder layer, parameter and FLOP counts."""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.loading import load_config, meta_model


def check_model(recipe: Recipe) -> str:
    """Deep recipe checks that need the architecture but no weights; returns a one-line summary."""
    config = load_config(recipe.model, offline=True)
    if config is None:
        return f"{recipe.model.name_or_path}: config not available offline, layer class not checked"
    positions = getattr(config, "max_position_embeddings", None)
    if positions and recipe.data.max_length > positions:
        raise UserError(f"data.max_length: {recipe.data.max_length} exceeds the model's {positions} positions")
    if recipe.model.quantize != "none":
        from lowmem_tpu.model.quantize import check_quantizable

        check_quantizable(config, recipe.model.quantize_lm_head)
    model = meta_model(config)
    layer = layer_class(model, recipe.sharding.layer_class)
    params = sum(p.numel() for p in model.parameters())
    count = sum(isinstance(m, layer) for m in model.modules())
    return f"{type(model).__name__}, {params / 1e9:.2f} B parameters, {count} x {layer.__name__}"


def layer_class(model: Any, name: str | None) -> type:
    """The decoder layer class to wrap: ``name``, or the model's own ``_no_split_modules``."""
    names = [name] if name else list(getattr(_base(model), "_no_split_modules", None) or [])
    classes = {type(m).__name__: type(m) for m in model.modules()}
    for candidate in names:
        if candidate in classes:
            return classes[candidate]
    raise UserError(
        f"sharding.layer_class: {names[0] if names else 'no decoder layer class'} is not a module of this model; "
        f"its classes include {', '.join(sorted(c for c in classes if 'Layer' in c or 'Block' in c)) or 'none'}"
    )


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; a quantized weight counts as the weights it stands for."""
    from lowmem_tpu.model.quantize import logical_parameters

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, logical_parameters(model)


def flops_per_token(config: Any, total: int, trainable: int, seq_len: int, lora: bool) -> float:
    """Training FLOPs per token, counting LoRA's cheaper backward honestly.

    Forward: 2 per weight, plus attention's two matmuls (scores and the weighted sum of values:
    4 x layers x hidden x seq, causal masking not subtracted, as PaLM's MFU counts it). Backward:
    twice the forward for both: gradients of the activations (2 per weight) and of the weights (2 per
    *trainable* weight: a frozen base skips those), and attention's backward is two matmuls per
    forward matmul whether or not anything trains. Recomputation by checkpointing is not counted
    (model FLOPs, not hardware FLOPs).
    """
    layers, hidden = config.num_hidden_layers, config.hidden_size
    embedding = config.vocab_size * hidden  # a lookup, not a matmul
    dense = total - embedding
    trained = trainable - (0 if lora else embedding)
    attention = 4 * layers * hidden * seq_len
    forward = 2 * dense + attention
    return forward + (2 * dense + 2 * attention) + 2 * trained
