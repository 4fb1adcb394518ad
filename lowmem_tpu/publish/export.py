"""Writing what training produced: the LoRA adapter (PEFT format) or the full model.

Parameter names are taken from the model before it was wrapped (``model.names.ParamNames``),
so the FSDP and checkpoint wrappers never leak into saved keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowmem_tpu.model.lora import INITIAL_ADAPTER

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def for_the_original_base(
    state: dict[str, torch.Tensor], config: dict[str, Any], initial: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PiSSA/OLoRA adapter made to apply to the original base, as PEFT converts one.

    Those adapters start from the base's principal directions (``B0 A0``) and the base trains as the
    residual ``W - B0 A0``; ``W + (B A - B0 A0)`` is the trained model, so ``[A; A0]`` and ``[B, -B0]``
    (rank and alpha doubled, alpha by sqrt 2 with rsLoRA: the same scale) is a plain LoRA adapter of it.
    """
    out = dict(state)
    for key in state:
        if ".lora_A." in key:
            out[key] = torch.cat([state[key], initial[key]], dim=0)
        elif ".lora_B." in key:
            out[key] = torch.cat([state[key], -initial[key]], dim=1)
    scale = 2**0.5 if config.get("use_rslora") else 2
    config = config | {"r": config["r"] * 2, "lora_alpha": config["lora_alpha"] * scale, "init_lora_weights": True}
    return out, config


def save_adapter(peft_model: Any, state: dict[str, torch.Tensor], out: Path, base_name_or_path: str) -> list[str]:
    """Save the LoRA adapter as PEFT does (weights under PEFT's keys, ``ParamNames.adapter_state``, + config
    naming its base); returns the keys."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(str(out))
    initial = getattr(peft_model, "initial_adapter", None)
    if initial:
        state, fields = for_the_original_base(state, json.loads((out / ADAPTER_CONFIG).read_text()), initial)
        (out / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
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

    from safetensors.torch import load_file, save_file

    from lowmem_tpu.files import fresh_partial, publish

    keys_file = info / "adapter_keys.json"
    partial = fresh_partial(out)
    for path in info.iterdir():
        if path.name not in (keys_file.name, INITIAL_ADAPTER):
            shutil.copy2(path, partial / path.name)
    if keys_file.is_file():
        keys = json.loads(keys_file.read_text())
        state = {key: trainable[name].contiguous() for key, name in keys.items()}
        if (info / INITIAL_ADAPTER).is_file():
            config = json.loads((info / ADAPTER_CONFIG).read_text())
            state, config = for_the_original_base(state, config, load_file(str(info / INITIAL_ADAPTER)))
            (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(partial / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    else:
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict({k: v.contiguous() for k, v in trainable.items()}, partial, max_shard_size="2GB")
    publish(partial, out)
    return "adapter" if keys_file.is_file() else "model"
