"""LoRA adapters (PEFT) on the frozen base, or every weight trainable for full fine-tuning."""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.architecture import lora_targets


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
        target_modules=lora_targets(model, lora.target_modules),
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        init_lora_weights=lora.init_lora_weights,
        modules_to_save=lora.modules_to_save,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        fields = "lora.modules_to_save" if lora.modules_to_save and "modules_to_save" in str(err) else "lora"
        raise UserError(f"{fields}: {err}") from None
