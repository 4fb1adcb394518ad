"""Base model and tokenizer: Hub ids, local directories and the shipped tiny Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError
from lowmem_tpu.recipe import BUILTIN, ModelSection, Recipe, resolve_builtin

CONFIGS = Path(__file__).parent / "configs"


def resolve_source(name_or_path: str) -> str:
    """A ``builtin:`` name becomes its packaged directory; anything else is returned as is."""
    return str(resolve_builtin(name_or_path)) if name_or_path.startswith(BUILTIN) else name_or_path


def shipped_config_path(name_or_path: str) -> Path | None:
    """A config this project ships for a known Hub model (so nothing has to be downloaded)."""
    path = CONFIGS / (name_or_path.replace("/", "__") + ".json")
    return path if path.exists() else None


def load_config(cfg: ModelSection, offline: bool = False) -> Any:
    """The model's config: local or built-in directory, shipped copy, or the Hub.

    With ``offline`` only local files are read and ``None`` is returned when none exist.
    """
    from transformers import AutoConfig

    source = resolve_source(cfg.name_or_path)
    if Path(source).expanduser().is_dir():
        return AutoConfig.from_pretrained(Path(source).expanduser())
    shipped = shipped_config_path(source)
    if offline or (cfg.random_init and shipped):
        if shipped:
            return AutoConfig.from_pretrained(shipped)
        try:
            return AutoConfig.from_pretrained(source, revision=cfg.revision, local_files_only=True)
        except OSError:
            return None
    try:
        return AutoConfig.from_pretrained(source, revision=cfg.revision)
    except OSError as err:
        raise UserError(f"model.name_or_path: cannot load the config of {source!r}: {err}") from None


def meta_model(config: Any) -> Any:
    """The model's module tree with no memory behind it (for checks and planning)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_model(recipe: Recipe) -> str:
    """Deep recipe checks that need the architecture but no weights; returns a one-line summary."""
    config = load_config(recipe.model, offline=True)
    if config is None:
        return f"{recipe.model.name_or_path}: config not available offline, layer class not checked"
    from lowmem_tpu.sharding import layer_class

    positions = getattr(config, "max_position_embeddings", None)
    if positions and recipe.data.max_length > positions:
        raise UserError(f"data.max_length: {recipe.data.max_length} exceeds the model's {positions} positions")
    if recipe.model.quantize != "none":
        from lowmem_tpu.quantize import check_quantizable

        check_quantizable(config, recipe.model.quantize_lm_head)
    model = meta_model(config)
    layer = layer_class(model, recipe.sharding.layer_class)
    params = sum(p.numel() for p in model.parameters())
    count = sum(isinstance(m, layer) for m in model.modules())
    return f"{type(model).__name__}, {params / 1e9:.2f} B parameters, {count} x {layer.__name__}"


def load_tokenizer(cfg: ModelSection) -> Any:
    """The tokenizer, with a pad token that is not needed to mark the end of text.

    Padding is masked by position in ``data``, so even a pad equal to EOS leaves the
    EOS a trained label; we still prefer a distinct token (``model.pad_token``, else unk).
    """
    from transformers import AutoTokenizer

    source = resolve_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, use_fast=cfg.use_fast_tokenizer, revision=cfg.revision)
    except (OSError, ValueError) as err:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source!r}: {err}") from None
    if tokenizer.pad_token is None or cfg.pad_token:
        choice = cfg.pad_token or tokenizer.unk_token or tokenizer.eos_token
        if choice is None or choice not in tokenizer.get_vocab():
            raise UserError(f"model.pad_token: {choice!r} is not a token of this tokenizer; name one it has")
        tokenizer.pad_token = choice
    tokenizer.padding_side = "right"
    return tokenizer


def torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_model(cfg: ModelSection, seed: int) -> Any:
    """The base causal LM on the host, in the recipe's dtype (random weights if asked).

    With ``model.quantize`` a checkpoint is quantized as it is read; a random-init base is
    returned in full precision (it is saved as the adapter's base) for ``quantize_base``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(cfg.dtype)
    if cfg.quantize != "none" and not cfg.random_init:
        from lowmem_tpu.quantize import load_quantized

        source = resolve_source(cfg.name_or_path)
        config = load_config(cfg)
        return load_quantized(
            source,
            cfg.revision,
            config,
            cfg.quantize,
            cfg.quantize_group_size,
            cfg.quantize_lm_head,
            dtype,
            cfg.attn_implementation,
        )
    if cfg.random_init:
        config = load_config(cfg)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation)
    else:
        source = resolve_source(cfg.name_or_path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, revision=cfg.revision, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
        except OSError as err:
            raise UserError(
                f"model.name_or_path: cannot load weights from {source!r} ({err}); "
                "give a local directory, a reachable Hub id, or set model.random_init: true"
            ) from None
    model.config.use_cache = False
    return model


def quantize_base(model: Any, cfg: ModelSection) -> int:
    """Quantize what ``load_model`` left in full precision (a random-init base); returns the layer count."""
    if cfg.quantize == "none":
        return 0
    from lowmem_tpu.quantize import quantize_model

    return quantize_model(model, cfg.quantize, cfg.quantize_group_size, cfg.quantize_lm_head)


def align_special_tokens(model: Any, tokenizer: Any) -> None:
    """Tell the model config which ids the tokenizer pads and ends with."""
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None:
            config.pad_token_id = tokenizer.pad_token_id
            config.eos_token_id = tokenizer.eos_token_id


def apply_lora(model: Any, recipe: Recipe) -> Any:
    """Wrap the base in PEFT LoRA adapters (the base is frozen), or leave every weight trainable."""
    if not recipe.lora.enabled:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = recipe.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        raise UserError(f"lora.target_modules: {err}") from None


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; a quantized weight counts as the weights it stands for."""
    from lowmem_tpu.quantize import logical_parameters

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, logical_parameters(model)


def flops_per_token(config: Any, total: int, trainable: int, seq_len: int, lora: bool) -> float:
    """Training FLOPs per token, counting LoRA's cheaper backward honestly.

    Forward: 2 per weight plus attention (4 x layers x hidden x seq). Backward: the same again for
    activation gradients, plus 2 per *trainable* weight for weight gradients; a frozen base
    skips those. Recomputation by checkpointing is not counted (this is model FLOPs, not hardware).
    """
    layers, hidden = config.num_hidden_layers, config.hidden_size
    embedding = config.vocab_size * hidden  # a lookup, not a matmul
    dense = total - embedding
    trained = trainable - (0 if lora else embedding)
    attention = 4 * layers * hidden * seq_len
    return 2 * dense + attention + 2 * dense + attention + 2 * trained
