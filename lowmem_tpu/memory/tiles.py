"""How many bytes an array takes in a TPU's HBM: its shard's shape, padded to the chip's tiles.

Read off the TPU compiler's buffer assignments (libtpu 0.0.21 for v5e, ``lowmem-tpu memory
--compile``): a 2-D or larger array is stored in (8, 128) tiles of its two minor dimensions, and
the compiler picks whichever of the two goes minor pads less (``f32[50,16]`` took 8 KiB, as
``[16, 128]``; ``bf16[4000,400]`` 3.1 MiB, as ``[400, 4096]``); a vector is padded to 128
elements; every buffer takes at least 512 bytes. For large arrays this changes little; for a small
model's adapters and norms it is most of their memory.
"""

from __future__ import annotations

import math

TILE_MINOR, TILE_SECOND = 128, 8
MIN_BUFFER = 512


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_elements(shape: tuple[int, ...] | list[int]) -> int:
    """Elements the TPU stores for an array of this shape (its tiles' padding included)."""
    if not shape:
        return 1
    if len(shape) == 1:
        return _up(shape[0], TILE_MINOR)
    *rest, a, b = shape
    tiled = min(_up(a, TILE_SECOND) * _up(b, TILE_MINOR), _up(b, TILE_SECOND) * _up(a, TILE_MINOR))
    return math.prod(rest) * tiled


def tpu_bytes(shape: tuple[int, ...] | list[int], itemsize: int) -> int:
    """Bytes of one buffer of this shape in HBM."""
    return max(padded_elements(shape) * itemsize, MIN_BUFFER)


def shard_shape(shape: tuple[int, ...] | list[int], strategy: str, devices: int) -> tuple[int, ...]:
    """One chip's shard: FSDP splits the largest dimension (the first of equals), as ``xla.sharding`` does."""
    if strategy != "fsdp" or devices == 1 or not shape:
        return tuple(shape)
    axis = max(range(len(shape)), key=lambda i: shape[i])
    return tuple(-(-d // devices) if i == axis else d for i, d in enumerate(shape))


def tpu_shard_bytes(shape: tuple[int, ...] | list[int], itemsize: int, strategy: str, devices: int) -> int:
    """Bytes of one chip's shard of a parameter-like array in HBM."""
    return tpu_bytes(shard_shape(shape, strategy, devices), itemsize)
