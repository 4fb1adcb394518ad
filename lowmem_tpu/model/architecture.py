"""What the architecture is, without weights: checks, the decoder layer, parameter and FLOP counts."""

from __future__ import annotations

import re
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.features import attention_of, chunked_loss_refusal, experts_of, layers_differ, text_config
from lowmem_tpu.config.model_fields import LORA_TARGETS
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.build import load_config, meta_model


def check_model(recipe: Recipe) -> str:
    """Deep recipe checks that need the architecture but no weights; returns a one-line summary."""
    config = load_config(recipe.model, offline=True)
    if config is None:
        return f"{recipe.model.name_or_path}: config not available offline, layer class not checked"
    positions = getattr(text_config(config), "max_position_embeddings", None)
    if positions and recipe.data.max_length > positions:
        raise UserError(f"data.max_length: {recipe.data.max_length} exceeds the model's {positions} positions")
    check_attention(recipe, config)
    if recipe.sharding.scan_layers and layers_differ(config):
        raise UserError(
            "sharding.scan_layers: this model's layers differ in shape (Gemma 4: full and sliding layers' heads, "
            "layers that reuse others' K/V), and a scan runs one compiled layer for all of them; set "
            "sharding.scan_layers: false"
        )
    if recipe.train.chunked_loss and (reason := chunked_loss_refusal(config)):
        raise UserError(reason)
    if recipe.model.quantize != "none":
        from lowmem_tpu.model.quantize import check_quantizable

        check_quantizable(config, recipe.model.quantize_lm_head, recipe.model.quantize)
    model = meta_model(config)
    layer = layer_class(model, recipe.sharding.layer_class)
    if recipe.lora.enabled:
        lora_targets(model, recipe.lora.target_modules)
    params = sum(p.numel() for p in model.parameters())
    count = sum(isinstance(m, layer) for m in model.modules())
    return f"{type(model).__name__}, {params / 1e9:.2f} B parameters, {count} x {layer.__name__}"


def check_attention(recipe: Recipe, config: Any) -> None:
    """Refuse an attention setting that would not compute the model's own attention (windows, soft-caps);
    ``sft`` checks the built model's config again, for a model whose config was not at hand offline."""
    data = recipe.data
    reason = attention_of(config).refusal(recipe.model.attn_implementation, data.packing, data.max_length)
    if reason:
        raise UserError(reason)


def layer_class(model: Any, name: str | None) -> type:
    """The decoder layer class to wrap: ``name``, or the text decoder's own layer.

    ``_no_split_modules`` is a set in transformers 5 that also names a multimodal model's vision layers,
    so it is consulted, in sorted order, only for a model whose decoder has no ``layers`` list.
    """
    decoder = decoder_layers(model)
    fallback = sorted(getattr(_base(model), "_no_split_modules", None) or [])
    names = [name] if name else ([type(decoder[0]).__name__] if decoder else fallback)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    for candidate in names:
        if candidate in classes:
            return classes[candidate]
    raise UserError(
        f"sharding.layer_class: {names[0] if names else 'no decoder layer class'} is not a module of this model; "
        f"its classes include {', '.join(sorted(c for c in classes if 'Layer' in c or 'Block' in c)) or 'none'}"
    )


def decoder_layers(model: Any) -> Any:
    """The text decoder's list of layers (``model.layers`` of Llama-style models), or None."""
    base = _base(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return layers if layers is not None and len(layers) else None


def decoder_projections(model: Any) -> tuple[str, list[str]]:
    """(the decoder layers' path, the names of the linear projections inside them, in module order); a MoE
    router's own projection is not one of them."""
    from torch import nn

    layers = decoder_layers(model)
    if layers is None:
        raise UserError("lora.target_modules: this model has no decoder layers list to find its projections in")
    path = next(name for name, module in model.named_modules() if module is layers)
    modules = dict(layers[0].named_modules())
    routers = [f"{name}." for name, module in modules.items() if type(module).__name__.endswith("Router")]
    names: list[str] = []
    for name, module in modules.items():
        leaf = name.rpartition(".")[2]
        routing = any(name.startswith(router) for router in routers)  # Gemma 4's router.proj
        if isinstance(module, nn.Linear) and leaf not in names and not routing:
            names.append(leaf)
    return path, names


# The Linear projections a stacked expert tensor stands for: listing one of them adapts that stack.
EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj", "gate_up_proj"), "down_proj": ("down_proj",)}


def expert_stacks(model: Any) -> list[str]:
    """The decoder layers' stacked expert parameters (3-D), as ``relative.path.leaf`` (``mlp.experts.down_proj``)."""
    layers = decoder_layers(model)
    found: list[str] = []
    for layer in layers or []:
        for name, param in layer.named_parameters():
            if param.dim() == 3 and name not in found:
                found.append(name)
    return found


def expert_targets(model: Any, requested: list[str] | str) -> list[str]:
    """PEFT's ``target_parameters``: the stacked experts the requested projections stand for (gate or up:
    ``gate_up_proj``; down: ``down_proj``); all-linear and the default list take every stack. A router is never
    adapted."""
    wanted = set(LORA_TARGETS) if requested == "all-linear" else set(requested)
    stacks = expert_stacks(model)
    return [name for name in stacks if wanted & set(EXPERT_PROJECTIONS.get(name.rpartition(".")[2], ()))]


def lora_targets(model: Any, requested: list[str] | str) -> list[str] | str:
    """PEFT's ``target_modules`` for this model.

    The default list (Llama's seven projections) follows the model's own projections: Phi's fused
    ``qkv_proj`` and ``gate_up_proj`` included. A listed name that matches no module is an error naming
    the decoder's projections, unless it stands for a stack of experts (``expert_targets``). Where a name
    (or ``all-linear``) also matches modules outside the text decoder (a multimodal model's vision tower),
    the targets become a pattern held to the decoder's layers.
    """
    from torch import nn

    path, projections = decoder_projections(model)
    inside = f"{path}."
    if requested == "all-linear":
        outside = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(inside)]
        # PEFT reads all-linear on a MoE model as transformers 4's Linears, the router among them: named instead
        if all(name.rpartition(".")[2] == "lm_head" for name in outside) and not expert_stacks(model):
            return requested
        requested = projections
    names = list(requested)
    if tuple(names) == LORA_TARGETS and not set(names) <= set(projections):
        names = projections
    leaves = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    stacked = {p for stack in expert_targets(model, names) for p in EXPERT_PROJECTIONS[stack.rpartition(".")[2]]}
    unknown = [name for name in names if name not in leaves and name not in stacked]
    if unknown:
        stacks = ", ".join(expert_stacks(model))
        raise UserError(
            f"lora.target_modules: {', '.join(unknown)} matches no module of this model; its decoder layers' "
            f"projections are {', '.join(projections)}{f' and its experts {stacks}' if stacks else ''} "
            "(or use all-linear)"
        )
    names = [name for name in names if name in leaves]
    elsewhere = any(
        name.rpartition(".")[2] in names and not name.startswith(inside) for name, _ in model.named_modules()
    )
    if not elsewhere:
        return names
    return rf"{re.escape(path)}\.\d+\.(.*\.)?({'|'.join(map(re.escape, names))})"


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; a quantized weight counts as the weights it stands for."""
    from lowmem_tpu.model.quantize import logical_parameters

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, logical_parameters(model)


def flops_per_token(
    config: Any, total: int, trainable: int, seq_len: int, lora: bool, forward_passes: int = 1
) -> float:
    """Training FLOPs per token, counting LoRA's cheaper backward honestly.

    Forward: 2 per weight, plus attention's two matmuls (scores and the weighted sum of values:
    4 x layers x hidden x seq, causal masking not subtracted, as PaLM's MFU counts it). Backward:
    twice the forward for both: gradients of the activations (2 per weight) and of the weights (2 per
    *trainable* weight: a frozen base skips those), and attention's backward is two matmuls per
    forward matmul whether or not anything trains. Recomputation by checkpointing is not counted
    (model FLOPs, not hardware FLOPs). A MoE model counts its active parameters. ``forward_passes``:
    forward passes over the rows per step (DPO's with its reference: 2; KTO's: 4).
    """
    config = text_config(config)  # a multimodal model's: its text decoder's
    layers, hidden = config.num_hidden_layers, config.hidden_size
    # The embedding is a lookup, not a matmul; a tied one (Gemma's) is the LM head's matmul too, counted once
    # in ``total``: then nothing is taken off.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embedding = 0 if tied else config.vocab_size * hidden
    # Gemma 4's per-layer embeddings (PLE): a lookup too, a table of [vocab, layers x its width]
    ple = getattr(config, "hidden_size_per_layer_input", 0) or 0
    embedding += ple * layers * (getattr(config, "vocab_size_per_layer_input", None) or config.vocab_size)
    # A MoE token goes through its top-k experts only: the others' weights cost it nothing
    experts = experts_of(config)
    idle = experts.idle(hidden) if experts else 0
    dense = total - embedding - idle
    trained = trainable - (0 if lora else embedding + idle)
    attention = 4 * layers * hidden * seq_len
    forward = 2 * dense + attention
    return forward * forward_passes + (2 * dense + 2 * attention) + 2 * trained
