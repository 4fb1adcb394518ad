"""gpt-oss's experts as the Hub stores them, MXFP4, dequantized while the checkpoint is read.

The Hub's gpt-oss keeps each expert stack as ``{stack}_blocks`` [experts, out, in / 32, 16] (two 4-bit E2M1
codes a byte, the even element in the low nibble) and ``{stack}_scales`` [experts, out, in / 32] (a power of
two per block of 32: the byte minus 127), with ``quantization_config.quant_method: mxfp4`` in its config.
transformers dequantizes them when it cannot run its Triton kernels (``integrations/mxfp4.py``): each value
is ``FP4[code] * 2 ** (scale - 127)``, transposed to the model's ``[experts, in, out]``. The same is done here
as the pair is read, one stack at a time, so training, LoRA and merge see the bf16 weights transformers
builds; the merged model is saved unquantized.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lowmem_tpu.errors import UserError

if TYPE_CHECKING:
    import torch

# E2M1 by code: the sign in bit 3, {0, 0.5, 1, 1.5, 2, 3, 4, 6} in bits 0-2
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PARTS = ("_blocks", "_scales")


def readable_config(config: Any, source: str) -> Any:
    """``config`` as the loader builds it: an MXFP4 checkpoint's quantization dropped (its experts are
    dequantized as read); a checkpoint stored in another quantized format refused."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return config
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if str(method) != "mxfp4":
        raise UserError(
            f"model.name_or_path: {source} is stored quantized ({method}); the loader reads full-precision "
            "checkpoints (and gpt-oss's MXFP4 experts). Give the unquantized checkpoint: model.quantize "
            "(int8, int4, nf4) quantizes it as it is read"
        )
    del config.quantization_config
    return config


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each ``{stack}_blocks``/``{stack}_scales`` pair read as ``{stack}``
    (float32, [experts, in, out]); the first of a pair waits for the other (the Hub stores them side by side)."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        part = next((p for p in PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        stack = name.removesuffix(part)
        pair = waiting.setdefault(stack, {})
        pair[part] = tensor
        if len(pair) == 2:
            del waiting[stack]
            yield stack, dequantize(pair["_blocks"], pair["_scales"])
    if waiting:
        stack, pair = next(iter(waiting.items()))
        missing = next(p for p in PARTS if p not in pair)
        raise UserError(f"model.name_or_path: the checkpoint has {stack}{next(iter(pair))} but no {stack}{missing}")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., out, groups, 16] and ``scales`` [..., out, groups] as float32 [..., in, out]
    (exact: every E2M1 value times a power of two is a float32), one expert at a time."""
    import torch

    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UserError(
            f"model.name_or_path: MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales "
            f"{tuple(scales.shape)} do not pair as [..., out, groups, 16] and [..., out, groups] bytes"
        )
    codes = torch.tensor(FP4, dtype=torch.float32)
    *lead, out, groups, _ = blocks.shape
    result = torch.empty(*lead, groups * 32, out, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, out, groups, 16), scales.reshape(-1, out, groups)
    for index, target in enumerate(result.reshape(-1, groups * 32, out)):
        packed = flat_blocks[index].long()
        values = torch.stack((codes[packed & 0x0F], codes[packed >> 4]), dim=-1).reshape(out, groups, 32)
        exponent = flat_scales[index].long() - 127
        target.copy_(torch.ldexp(values, exponent[..., None].float()).reshape(out, groups * 32).T)
    return result
