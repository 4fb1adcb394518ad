"""Two 4-bit indices a byte, laid out for the TPU: the layout int4 and NF4 (``model.nf4``) share.

An ``[out, in]`` matrix of indices is stored as ``[in / 2, out]``: the byte at ``[j, o]`` holds row ``o``'s
index ``j`` in its high nibble and index ``j + in / 2`` in its low one. Unpacking is two elementwise passes
over the bytes, each giving a half of the transpose's rows; a matmul takes the transpose as it is. Adjacent
inputs in one byte (bitsandbytes' order) would interleave the nibbles along the minor dimension: a lane
shuffle the TPU compiler materialises as an ``[out, in / 2, 2]`` byte tensor, most of a quantized step's
time by its cost model (docs/qlora.md).
"""

from __future__ import annotations

import torch


def pack_halves(indices: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` indices in 0..15 (uint8, ``in`` even) as ``[in / 2, out]`` bytes."""
    half = indices.shape[1] // 2
    return ((indices[:, :half] << 4) | indices[:, half:]).t().contiguous()


def unpack_halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transpose's first and second half of rows (``[in / 2, out]`` each, uint8) of packed bytes."""
    return packed >> 4, packed & 15
