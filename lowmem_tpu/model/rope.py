"""Rotary embeddings without lane shuffles: ``rotate_half`` as a matmul with a signed permutation.

transformers' families rotate each query and key head by ``cat(-x[..., h:], x[..., :h])`` (``h`` half the
head). A TPU tiles the last dimension in 128 lanes; when ``h`` is not a multiple of 128 (Llama's 64, Open
Llama's 50, Phi-3's 48) the two slices and the concatenation shift every element across lanes, forward and
backward. libtpu's cost model puts that at 8% of Open Llama 3B's LoRA step and 5% of Llama 3.2 3B's
(docs/speed.md). The same rotation is ``x @ R`` with ``R[j, j + h] = 1`` and ``R[j + h, j] = -1``: one small
matmul on the MXU, exact in bfloat16 (each output is one input times +-1, accumulated in fp32 with zeros).

:func:`use_matmul_rotation` swaps it into the modeling module of each layer of a model, only where that
module's own ``rotate_half`` gives the same values (checked on the CPU when swapped: a family that rotates
differently keeps its own), and only for bfloat16 tensors whose half is not lane-aligned (anything else
takes the model's own path).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType

import torch

LANES = 128  # a TPU vector register's lane count: the tile of an array's last dimension

_ORIGINAL = "_lowmem_tpu_rotate_half"  # where a swapped module keeps its own rotate_half


def rotation(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, n]: ``x @ rotation(n)`` equals ``cat(-x[..., n/2:], x[..., :n/2])``. Built from iotas, so XLA folds
    it into a constant of the program."""
    i = torch.arange(n, device=device)
    half = n // 2
    plus = i[None, :] == i[:, None] + half  # out[j + h] takes x[j]
    minus = i[:, None] == i[None, :] + half  # out[j] takes -x[j + h]
    return plus.to(dtype) - minus.to(dtype)


def by_matmul(original: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``original`` (a family's ``rotate_half``), as a matmul where that saves lane shuffles."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if x.dtype != torch.bfloat16 or n % 2 or (n // 2) % LANES == 0:
            return original(x)
        return torch.matmul(x, rotation(n, x.dtype, x.device))

    rotate_half.__wrapped__ = original  # type: ignore[attr-defined]
    return rotate_half


def _agrees(original: Callable[[torch.Tensor], torch.Tensor], head: int) -> bool:
    swapped = by_matmul(original)
    generator = torch.Generator().manual_seed(0)
    for n in sorted({8, 100, head}):
        x = torch.randn(2, 3, 5, n, generator=generator).to(torch.bfloat16)
        try:
            if not torch.equal(original(x), swapped(x)):
                return False
        except (RuntimeError, IndexError):
            return False
    return True


def use_matmul_rotation(model: torch.nn.Module) -> list[str]:
    """Swap :func:`by_matmul` into the modeling module of every layer of ``model`` that defines a
    ``rotate_half`` it agrees with; the names of the modules that use it (idempotent)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    head = getattr(text, "head_dim", None) or 128
    swapped = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if _swap(module, int(head)):
            swapped.append(name)
    return swapped


def _swap(module: ModuleType | None, head: int) -> bool:
    if module is None or not callable(getattr(module, "rotate_half", None)):
        return False
    if hasattr(module, _ORIGINAL):
        return True
    original = module.rotate_half
    if not _agrees(original, head):
        return False
    setattr(module, _ORIGINAL, original)
    module.rotate_half = by_matmul(original)
    return True
