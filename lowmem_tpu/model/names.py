"""Clean parameter names, recorded before FSDP wrapping, for checkpoints and the saved adapter or model."""

from __future__ import annotations

import torch
from torch import nn


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
