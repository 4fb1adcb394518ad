"""Rotary embeddings without lane shuffles: ``rotate_half`` as a matmul by a signed permutation.

Most families rotate each query and key head by ``cat(-x[..., h:], x[..., :h])``; where ``h`` is not a whole
number of TPU lanes, the slices and the concatenation move every element across lanes. ``x @ R``, with
``R[j, j + h] = 1`` and ``R[j + h, j] = -1``, is the same rotation on the MXU (docs/speed.md, "Rotary
embeddings by a matmul").
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from lowmem_tpu.config.devices import LANES

Rotation = Callable[[torch.Tensor], torch.Tensor]
CHECKED = (8, 48, 100)  # head halves of 4, 24 and 50: sizes where halves and interleaved pairs differ
_ORIGINAL = "_lowmem_tpu_rotate_half"  # where a swapped module keeps its own rotate_half


def rotation(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, n]: ``x @ rotation(n)`` is ``cat(-x[..., n/2:], x[..., :n/2])``. Built from iotas, so XLA folds
    it into a constant of the program."""
    i = torch.arange(n, device=device)
    half = n // 2
    plus = i[None, :] == i[:, None] + half  # out[j + h] takes x[j]
    minus = i[:, None] == i[None, :] + half  # out[j] takes -x[j + h]
    return plus.to(dtype) - minus.to(dtype)


def by_matmul(original: Rotation) -> Rotation:
    """``original`` (a family's ``rotate_half``) as a matmul for bfloat16 halves that are not lane-aligned;
    anything else (fp32, which a TPU's default matmul precision would round; Gemma's 256-wide heads) goes
    to ``original``."""

    @functools.wraps(original)
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if x.dtype != torch.bfloat16 or n % 2 or (n // 2) % LANES == 0:
            return original(x)
        return torch.matmul(x, rotation(n, x.dtype, x.device))

    return rotate_half


def agrees(original: Rotation) -> bool:
    """Whether ``original`` gives :func:`by_matmul`'s values (a family that rotates interleaved pairs, or
    with other signs, does not)."""
    swapped = by_matmul(original)
    generator = torch.Generator().manual_seed(0)
    for n in CHECKED:
        x = torch.randn(2, 3, 5, n, generator=generator).to(torch.bfloat16)
        try:
            if not torch.equal(original(x), swapped(x)):
                return False
        except Exception:  # a rotate_half of another signature or shape rule: not ours to replace
            return False
    return True


def use_matmul_rotation(model: torch.nn.Module) -> list[str]:
    """Swap :func:`by_matmul` into the modeling module of each of ``model``'s layers whose ``rotate_half``
    :func:`agrees`; the names of the modules that use it (idempotent)."""
    names = sorted({type(m).__module__ for m in model.modules()})
    return [name for name in names if _swap(sys.modules.get(name))]


def _swap(module: ModuleType | None) -> bool:
    original = getattr(module, "rotate_half", None)
    if module is None or not callable(original):
        return False
    if hasattr(module, _ORIGINAL):
        return True
    if not agrees(original):
        return False
    setattr(module, _ORIGINAL, original)
    module.rotate_half = by_matmul(original)
    return True
