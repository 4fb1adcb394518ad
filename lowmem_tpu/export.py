"""Writing what training produced: the LoRA adapter (PEFT format) or the full model.

Parameter names are taken from the model before it was wrapped (``ParamNames``), so the
FSDP and checkpoint wrappers never leak into saved keys. Every tensor is gathered from
the devices to the host one at a time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class ParamNames:
    """Clean ``name -> parameter`` map of a model, recorded before FSDP wrapping.

    For a PEFT model it also records which parameter each adapter key comes from: PEFT
    selects adapter tensors by module name, and the wrappers change module names.
    """

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())
        self.adapter_keys: dict[str, str] = {}
        if hasattr(model, "peft_config"):
            from peft.utils import get_peft_model_state_dict

            names = list(self.params)
            tags = {name: torch.tensor(i) for i, name in enumerate(names)}
            selected = get_peft_model_state_dict(model, state_dict=tags)
            self.adapter_keys = {key: names[int(tag)] for key, tag in selected.items()}

    def host_state(self) -> dict[str, torch.Tensor]:
        """Host copies of every parameter (gathered from their shards)."""
        return {name: _host(param) for name, param in self.params.items()}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Host copies of the adapter tensors under PEFT's saved names."""
        return {key: _host(self.params[name]) for key, name in self.adapter_keys.items()}


def _host(param: torch.Tensor) -> torch.Tensor:
    return param.detach().cpu().contiguous()


def save_adapter(peft_model: Any, names: ParamNames, out: Path, base_name_or_path: str) -> list[str]:
    """Save the LoRA adapter as PEFT does (weights + config naming its base); returns the keys."""
    from safetensors.torch import save_file

    state = names.adapter_state()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(str(out))
    return sorted(state)


def save_full_model(model: nn.Module, names: ParamNames, out: Path, max_shard_size: str = "2GB") -> None:
    """Save every parameter as safetensors shards that ``from_pretrained`` loads."""
    from huggingface_hub import save_torch_state_dict

    state = names.host_state()
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


def publish(partial: Path, final: Path) -> None:
    """Make a finished output visible in one rename (a crash never leaves half a ``final/``)."""
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
