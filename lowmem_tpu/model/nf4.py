"""NF4 with double quantization, QLoRA's format, in bitsandbytes' exact arithmetic.

A weight is cut into blocks of ``blocksize`` consecutive values of its row-major order (as
bitsandbytes does: a block crosses rows when the input width is not a multiple of it; the maxima are
then one flat vector, else ``[out, in / blocksize]``). Each block keeps its absolute maximum and, per
value, the index of the nearest of the 16 NormalFloat levels of ``value / absmax``. With double
quantization the fp32 maxima lose their mean (``offset``) and are themselves quantized to 8 bits in blocks
of 256 against bitsandbytes' signed dynamic code. Indices, maxima and second level are bitsandbytes'.

The indices are stored for the TPU (``model.nibbles``; :func:`to_bitsandbytes` gives bitsandbytes' bytes):
``[in / 2, out]``, the byte at ``[j, o]`` holding ``w[o, j]``'s index in its high nibble and
``w[o, j + in / 2]``'s in its low one.

Dequantizing computes every product in fp32 and casts once, as bitsandbytes does: products in
bf16 change about a fifth of the values. Under XLA, ``code2[q] * absmax2 + offset`` may fuse into one
FMA, so a few double-quantized maxima come out one fp32 ulp from bitsandbytes' (tests state it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from lowmem_tpu.model.nibbles import pack_halves, unpack_halves

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
    """``(indices, absmax)`` of a flat fp32 tensor cut into blocks; a short last block is scaled by a
    division, the others by the reciprocal, as bitsandbytes' kernel does."""
    full = values.numel() - values.numel() % blocksize
    blocks = values[:full].view(-1, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = [torch.clamp(blocks * (1.0 / absmax.clamp(min=TINY)).unsqueeze(-1), -1, 1).reshape(-1)]
    if full < values.numel():
        last = values[full:].abs().amax().clamp(min=TINY)
        absmax = torch.cat([absmax, last.unsqueeze(0)])
        scaled.append(torch.clamp(values[full:] / last, -1, 1))
    return _nearest(torch.cat(scaled), code), absmax


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
    """A quantized ``[out, in]`` weight: ``packed`` uint8 ``[in / 2, out]`` (the module's layout); ``absmax`` fp32
    ``[out, in / blocksize]`` (flat ``[ceil(out * in / blocksize)]`` when blocks cross rows), or with
    double quantization uint8 indices into ``dynamic_code()`` scaled by ``absmax2`` (fp32, one per 256
    maxima) plus ``offset`` (fp32, a scalar)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    absmax2: torch.Tensor | None
    offset: torch.Tensor | None


def maxima_shape(out_features: int, in_features: int, blocksize: int) -> tuple[int, ...]:
    """``[out, in / blocksize]`` when rows are whole blocks, else the flat ``[ceil(out * in / blocksize)]``."""
    if in_features % blocksize == 0:
        return (out_features, in_features // blocksize)
    return (-(-out_features * in_features // blocksize),)


def quantize_nf4(weight: torch.Tensor, blocksize: int, double: bool) -> NF4Weight:
    """NF4 of a 2-D weight of an even input width (two weights a byte, never across rows)."""
    out_features, in_features = weight.shape
    if in_features % 2:
        raise ValueError(f"{in_features} inputs: NF4 packs two weights a byte along a row")
    flat = weight.detach().reshape(-1).to(torch.float32)
    q, absmax = _blockwise(flat, blocksize, nf4_code())
    packed = pack_halves(q.view(out_features, in_features))
    absmax2 = offset = None
    if double:
        offset = absmax.mean()
        absmax, absmax2 = _second_level(absmax - offset)
    shape = maxima_shape(out_features, in_features, blocksize)
    return NF4Weight(packed, absmax.view(shape), absmax2, offset)


def block_maxima(weight: NF4Weight) -> torch.Tensor:
    """The fp32 maxima, shaped as stored (decoded from the second level if double)."""
    if weight.absmax2 is None:
        return weight.absmax
    shape, n = weight.absmax.shape, weight.absmax.numel()
    codes = dynamic_code().to(weight.absmax.device)[weight.absmax.reshape(-1).long()]
    blocks = torch.nn.functional.pad(codes, (0, -n % SECOND_BLOCK)).view(-1, SECOND_BLOCK)
    return (blocks * weight.absmax2.unsqueeze(-1)).reshape(-1)[:n].view(shape) + weight.offset


def to_bitsandbytes(packed: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' packed bytes (``[out * in / 2]``, adjacent inputs in one byte, the first high) of
    indices stored ``[in / 2, out]`` as this module stores them."""
    rows = torch.cat(unpack_halves(packed)).t()  # [out, in]: every index in its place
    return ((rows[:, 0::2] << 4) | rows[:, 1::2]).reshape(-1)


def levels(indices: torch.Tensor) -> torch.Tensor:
    """``nf4_code()[indices]`` in fp32, as a tree of selects on the index's bits: elementwise, so it fuses
    with the scaling and the cast (a lookup would materialize the fp32 weight)."""
    candidates: list = list(NF4_LEVELS)
    for bit in range(4):
        odd = (torch.bitwise_right_shift(indices, bit) & 1).bool()
        candidates = [torch.where(odd, candidates[i + 1], candidates[i]) for i in range(0, len(candidates), 2)]
    return candidates[0].to(torch.float32)


def dequantize_nf4(weight: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight, every product in fp32, cast to ``dtype`` once. It is computed as its transpose:
    where rows are whole blocks, a block is ``blocksize`` consecutive rows of it, so a maximum is broadcast
    along rows, not lanes. The final transpose is a layout for a matmul to absorb (``contiguous`` is a no-op
    on an XLA tensor, whose storage is always contiguous; on the CPU it gives the layout a product expects)."""
    half, out_features = weight.packed.shape
    maxima = block_maxima(weight)
    indices = unpack_halves(weight.packed)  # w^T's first and second half of rows
    if maxima.dim() == 2 and maxima.shape[1] % 2 == 0:  # each half of a row is whole blocks: scaled apart
        halves = [
            (levels(q).view(-1, 2 * half // maxima.shape[1], out_features) * m.t().unsqueeze(1)).to(dtype)
            for q, m in zip(indices, maxima.chunk(2, dim=1), strict=True)
        ]  # joined in ``dtype``: the fp32 levels of a whole weight never exist
        return torch.cat([h.view(half, out_features) for h in halves]).t().contiguous()
    values = torch.cat([levels(q) for q in indices])  # [in, out]
    if maxima.dim() == 2:  # rows of whole blocks, one straddling a row's halves
        scaled = values.view(maxima.shape[1], -1, out_features) * maxima.t().unsqueeze(1)
        return scaled.view(2 * half, out_features).to(dtype).t().contiguous()
    n = out_features * 2 * half
    blocksize = -(-n // maxima.numel())
    flat = torch.nn.functional.pad(values.t().reshape(-1), (0, -n % blocksize)).view(-1, blocksize)
    return (flat * maxima.unsqueeze(-1)).reshape(-1)[:n].view(out_features, -1).to(dtype)
