"""NF4 with double quantization, QLoRA's format, in bitsandbytes' exact layout and arithmetic.

A weight is cut into blocks of ``blocksize`` consecutive values (row-major; blocks never cross a
row here, so rows shard freely). Each block keeps its absolute maximum and, per value, the index of
the nearest of the 16 NormalFloat levels of ``value / absmax``, two indices per byte, the first in
the high nibble. With double quantization the fp32 maxima lose their mean (``offset``) and are
themselves quantized to 8 bits in blocks of 256 against bitsandbytes' signed dynamic code.

Dequantizing computes every product in fp32 and casts once, as bitsandbytes does: products in
bf16 change about a fifth of the values. Under XLA, ``code2[q] * absmax2 + offset`` may fuse into one
FMA, so a few double-quantized maxima come out one fp32 ulp from bitsandbytes' (tests state it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

# The 16 NormalFloat levels (QLoRA, appendix E), as bitsandbytes stores them.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
SECOND_BLOCK = 256  # maxima per second-level block, as bitsandbytes' double quantization uses
TINY = 1e-38  # bitsandbytes' floor for a block's maximum


@cache
def nf4_code() -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32)


@cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (its ``create_dynamic_map()`` default): for each
    exponent ``e`` in -6..0, ``2**(e+6)`` evenly spaced fractions in [0.1, 1] times ``10**e``, both
    signs, plus 0 and 1, sorted."""
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scaled = (10 ** (i - 6)) * means
        values += scaled.tolist() + (-scaled).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of a sorted code (a tie goes to the lower one), as uint8."""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)


def _blockwise(values: torch.Tensor, blocksize: int, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, absmax)`` of a flat fp32 tensor cut into blocks (the last may be short)."""
    n = values.numel()
    pad = -n % blocksize
    blocks = torch.nn.functional.pad(values, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=TINY)).unsqueeze(-1), -1, 1)
    return _nearest(scaled.reshape(-1)[:n], code), absmax


@cache
def _dynamic_lookup() -> torch.Tensor:
    """The nearest dynamic level of each of 65536 evenly spaced points of [-1, 1]: bitsandbytes' CPU
    kernel quantizes the maxima through this table, not by a nearest-level search."""
    grid = torch.arange(65536, dtype=torch.float32) / 65535 * 2 - 1
    code = dynamic_code()
    return torch.cat([(part[:, None] - code).abs().argmin(dim=-1) for part in grid.split(4096)]).to(torch.uint8)


def _second_level(maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The centred maxima to 8 bits in blocks of 256, as bitsandbytes' CPU kernel does: scaled into
    [-1, 1], rounded to the nearest of 65536 grid points, looked up."""
    n = maxima.numel()
    blocks = torch.nn.functional.pad(maxima, (0, -n % SECOND_BLOCK)).view(-1, SECOND_BLOCK)
    absmax = blocks.abs().amax(dim=-1)
    normed = torch.clamp(blocks * (1.0 / absmax.clamp(min=TINY)).unsqueeze(-1), -1, 1).reshape(-1)[:n]
    grid_point = (((normed + 1) * 0.5) * 65535 + 0.5).to(torch.int64)
    return _dynamic_lookup()[grid_point], absmax


@dataclass
class NF4Weight:
    """A quantized ``[out, in]`` weight: ``packed`` uint8 ``[out, in / 2]``; ``absmax`` fp32
    ``[out, in / blocksize]``, or with double quantization uint8 indices into ``dynamic_code()``
    scaled by ``absmax2`` (fp32, one per 256 maxima) plus ``offset`` (fp32, a scalar)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    absmax2: torch.Tensor | None
    offset: torch.Tensor | None


def quantize_nf4(weight: torch.Tensor, blocksize: int, double: bool) -> NF4Weight:
    """NF4 of a 2-D weight whose rows are whole blocks (``in % blocksize == 0``)."""
    out_features, in_features = weight.shape
    if in_features % blocksize:
        raise ValueError(f"{in_features} inputs are not a multiple of the NF4 block of {blocksize}")
    flat = weight.detach().reshape(-1).to(torch.float32)
    q, absmax = _blockwise(flat, blocksize, nf4_code())
    packed = (q[0::2] << 4) | q[1::2]
    absmax2 = offset = None
    if double:
        offset = absmax.mean()
        absmax, absmax2 = _second_level(absmax - offset)
    return NF4Weight(packed.view(out_features, -1), absmax.view(out_features, -1), absmax2, offset)


def block_maxima(weight: NF4Weight) -> torch.Tensor:
    """The fp32 ``[out, in / blocksize]`` maxima (decoded from the second level if double)."""
    if weight.absmax2 is None:
        return weight.absmax
    shape, n = weight.absmax.shape, weight.absmax.numel()
    codes = dynamic_code().to(weight.absmax.device)[weight.absmax.reshape(-1).long()]
    blocks = torch.nn.functional.pad(codes, (0, -n % SECOND_BLOCK)).view(-1, SECOND_BLOCK)
    return (blocks * weight.absmax2.unsqueeze(-1)).reshape(-1)[:n].view(shape) + weight.offset


def dequantize_nf4(weight: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight, every product in fp32, cast to ``dtype`` once."""
    packed = weight.packed
    out_features = packed.shape[0]
    indices = torch.stack((packed >> 4, packed & 15), dim=-1).view(out_features, -1).long()
    levels = nf4_code().to(packed.device)[indices]
    maxima = block_maxima(weight)
    blocks = levels.view(out_features, maxima.shape[1], -1) * maxima.unsqueeze(-1)
    return blocks.view(out_features, -1).to(dtype)
