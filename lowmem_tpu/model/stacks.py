"""Stacked expert tensors filled from the Hub's one-key-per-expert checkpoints, one tensor at a time.

transformers' loader reads Qwen 3 MoE's ``mlp.experts.{e}.gate_proj.weight``, ``up_proj`` and ``down_proj``
whole and then merges them (``MergeModulelist(dim=0)``, for gate and up ``Concatenate(dim=1)``) into the
model's ``experts.gate_up_proj`` [experts, 2 x inner, hidden] and ``experts.down_proj``. Here each expert's
tensor is copied into its place in a stack allocated once, as it is read, so no second copy of a layer's
experts is ever held. Only those two operations are followed; any other conversion is refused by the caller.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lowmem_tpu.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Slot:
    """Where one stored expert tensor goes in its stack: ``stack[expert]``, and with ``parts`` > 1 the
    ``part``-th of equal slices along ``dim`` of that expert's matrix (gate 0, up 1)."""

    expert: int
    part: int = 0
    parts: int = 1
    dim: int = 0


def expert_slot(converter: Any, pattern: str, stored: str) -> Slot | None:
    """The slot of ``stored`` (matched by ``pattern``, one of ``converter``'s sources), or None when the
    converter does more than stack experts and concatenate their parts."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or "*" not in pattern:
        return None
    concat = ops[1:]
    if len(concat) > 1 or (concat and not isinstance(concat[0], Concatenate)) or (concat and concat[0].dim < 1):
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), stored)
    if found is None:
        return None
    parts = len(converter.source_patterns)
    if parts > 1 and not concat:
        return None
    dim = concat[0].dim - 1 if concat else 0
    return Slot(int(found.group(1)), converter.source_patterns.index(pattern), parts, dim)


class ExpertStacks:
    """The model's stacked expert parameters, allocated on first use and filled slot by slot."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.filled: Counter[str] = Counter()
        self.needed: dict[str, int] = {}

    def place(self, name: str, slot: Slot, tensor: torch.Tensor, stored: str) -> None:
        import torch
        from torch import nn

        module_name, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        param = module._parameters[leaf]
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype), requires_grad=False)
            module._parameters[leaf] = param
            self.needed[name] = param.shape[0] * slot.parts
        target = param.data[slot.expert]
        if slot.parts > 1:
            size = target.shape[slot.dim] // slot.parts
            target = target.narrow(slot.dim, slot.part * size, size)
        if target.shape != tensor.shape:
            raise UserError(
                f"model.name_or_path: {stored!r} has shape {tuple(tensor.shape)}, where {name} expects "
                f"{tuple(target.shape)} per expert; is it a checkpoint of this architecture?"
            )
        target.copy_(tensor)
        self.filled[name] += 1

    def incomplete(self) -> list[str]:
        """Stacks some of whose experts the checkpoint never gave."""
        return [name for name, count in self.needed.items() if self.filled[name] < count]
