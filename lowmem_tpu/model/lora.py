"""LoRA adapters (PEFT) on the frozen base, or every weight trainable for full fine-tuning."""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.architecture import expert_targets, lora_targets

# PiSSA/OLoRA's adapters as initialised, beside a checkpoint's export files (the export converts with them).
INITIAL_ADAPTER = "initial_adapter.safetensors"


def apply_lora(model: Any, recipe: Recipe, weightless: bool = False) -> Any:
    """Wrap the base in PEFT LoRA adapters (the base is frozen), or leave every weight trainable.

    ``weightless``: the base has no values (``meta``, placeholders: the step measured, never trained);
    an initialisation that reads the base (PiSSA, OLoRA) is replaced by PEFT's default, which draws
    adapters of the same shapes."""
    if not recipe.lora.enabled:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = recipe.lora
    if recipe.model.adapter:
        return _from_adapter(model, recipe, weightless)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(model, lora.target_modules),
        target_parameters=expert_targets(model, lora.target_modules) or None,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        init_lora_weights=True if weightless and _reads_the_base(lora.init_lora_weights) else lora.init_lora_weights,
        modules_to_save=lora.modules_to_save,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft = get_peft_model(model, config, autocast_adapter_dtype=lora.dtype == "float32")
    except ValueError as err:
        fields = "lora.modules_to_save" if lora.modules_to_save and "modules_to_save" in str(err) else "lora"
        raise UserError(f"{fields}: {err}") from None
    if lora.dtype == "model":
        in_base_dtype(peft, model_dtype(recipe))
    if _reads_the_base(lora.init_lora_weights) and not weightless:
        # The base now holds the residual of the adapters' initial directions: the saved adapter is
        # converted to apply to the original base (publish.export.for_the_original_base).
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(peft)
        peft.initial_adapter = {k: v.detach().cpu().clone() for k, v in state.items() if ".lora_" in k}
    return peft


def _from_adapter(model: Any, recipe: Recipe, weightless: bool) -> Any:
    """The base with ``model.adapter`` on it, trainable, its own LoRA settings kept (weightless: its shapes,
    fresh values)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    source, autocast = recipe.model.adapter, recipe.lora.dtype == "float32"
    try:
        if weightless:
            config = LoraConfig.from_pretrained(source)
            config.inference_mode = False  # a saved adapter's config says inference: trained here
            peft = get_peft_model(model, config, autocast_adapter_dtype=autocast)
        else:
            peft = PeftModel.from_pretrained(model, source, is_trainable=True, autocast_adapter_dtype=autocast)
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # RuntimeError: shapes of another base
        raise UserError(
            f"model.adapter: {source} could not be loaded on {recipe.model.name_or_path} ({err}); give a run's "
            "final/ or a PEFT LoRA adapter made for this base"
        ) from None
    if recipe.lora.dtype == "model":
        in_base_dtype(peft, model_dtype(recipe))
    return peft


def in_base_dtype(peft: Any, dtype: Any) -> None:
    """Every adapter weight in the base's dtype (``lora.dtype: model``): PEFT leaves a quantized base's
    adapters fp32, so they are cast here whatever the base's weights are stored as."""
    for name, param in peft.named_parameters():
        if ".lora_" in name and param.dtype != dtype:
            param.data = param.data.to(dtype)


def model_dtype(recipe: Recipe) -> Any:
    import torch

    return getattr(torch, recipe.model.dtype)


def _reads_the_base(init: bool | str) -> bool:
    return str(init).startswith(("pissa", "olora"))
