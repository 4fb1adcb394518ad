"""Writing what training produced: the LoRA adapter (PEFT format) or the full model.

Parameter names are taken from the model before it was wrapped (``model.names.ParamNames``),
so the FSDP and checkpoint wrappers never leak into saved keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_adapter(peft_model: Any, state: dict[str, torch.Tensor], out: Path, base_name_or_path: str) -> list[str]:
    """Save the LoRA adapter as PEFT does (weights under PEFT's keys, ``ParamNames.adapter_state``, + config
    naming its base); returns the keys."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(str(out))
    return sorted(state)


def save_full_model(model: nn.Module, state: dict[str, torch.Tensor], out: Path, max_shard_size: str = "2GB") -> None:
    """Save every parameter (``ParamNames.host_state``) as safetensors shards that ``from_pretrained`` loads."""
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, out, max_shard_size=max_shard_size)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def check_adapter(out: Path, expected_keys: list[str]) -> None:
    """Prove the saved adapter is complete: PEFT parses its config and reads every tensor back."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    PeftConfig.from_pretrained(str(out))
    loaded = load_peft_weights(str(out), device="cpu")
    missing = sorted(set(expected_keys) - set(loaded))
    if missing or not loaded:
        raise RuntimeError(f"adapter in {out} is incomplete: missing {missing[:5]}")


def export_checkpoint(trainable: dict[str, torch.Tensor], info: Path, out: Path) -> str:
    """A training checkpoint's weights (clean names) written as the adapter or the model ``final/`` would hold.

    ``info`` is the checkpoint's ``export/`` (the adapter's config and key map, or the model's config, and
    the tokenizer); returns "adapter" or "model". Built beside ``out`` and renamed into place.
    """
    import json
    import shutil

    from safetensors.torch import save_file

    from lowmem_tpu.files import fresh_partial, publish

    keys_file = info / "adapter_keys.json"
    partial = fresh_partial(out)
    if keys_file.is_file():
        keys = json.loads(keys_file.read_text())
        state = {key: trainable[name].contiguous() for key, name in keys.items()}
        save_file(state, str(partial / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    else:
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict({k: v.contiguous() for k, v in trainable.items()}, partial, max_shard_size="2GB")
    for path in info.iterdir():
        if path.name != keys_file.name:
            shutil.copy2(path, partial / path.name)
    publish(partial, out)
    return "adapter" if keys_file.is_file() else "model"
