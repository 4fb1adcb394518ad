"""A frozen int8 or int4 base for QLoRA-style training, in plain PyTorch that XLA compiles.

Each quantized projection keeps an integer weight and its scales and dequantizes inside
its forward pass (``q.to(dtype) * scale``), so XLA gathers the small integer shards and
the full-precision weight of one projection exists only while it is used.

- int8: symmetric, one scale per output row (``w ~ q * scale``, ``q`` in [-127, 127]).
- int4: symmetric, one scale per group of ``group_size`` inputs (``q`` in [-7, 7]), two
  values per byte (low nibble first). An input width that is not a multiple of the group
  is zero-padded to one, and the padding is sliced off after dequantizing.

Scales are kept in the model's dtype; the integers are rounded against the stored scale,
so the scale's own rounding adds no error. ``model.loading`` quantizes a checkpoint while it
is read, one tensor at a time, so the full-precision model never exists in memory as a whole.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowmem_tpu.config.schema import QUANT_BITS as BITS
from lowmem_tpu.errors import UserError

QMAX = {8: 127, 4: 7}


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype):
    """``(q, scale)`` of a 2-D weight: int8 ``[out, in]`` + ``[out, 1]``, or packed uint8
    ``[out, padded_in / 2]`` + ``[out, padded_in / group_size]`` for int4."""
    w = weight.detach().to(torch.float32)
    out_features, in_features = w.shape
    qmax = QMAX[bits]
    if bits == 8:
        grouped = w.unsqueeze(1)  # one group: the whole row
    else:
        padded = math.ceil(in_features / group_size) * group_size
        grouped = F.pad(w, (0, padded - in_features)).view(out_features, -1, group_size)
    absmax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = (absmax / qmax).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
    q = torch.round(grouped / scale.to(torch.float32)).clamp(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q.view(out_features, in_features), scale.view(out_features)
    scale = scale.squeeze(-1)
    nibbles = (q.view(out_features, -1) + 8).to(torch.uint8)  # 1..15; 8 is zero
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[out, in]`` weight in ``dtype`` (on whatever device ``q`` lives)."""
    if bits == 8:
        return q.to(dtype) * scale.to(dtype).unsqueeze(-1)
    out_features = q.shape[0]
    low, high = q & 15, q >> 4
    values = torch.stack((low, high), dim=-1).view(out_features, -1, group_size).to(dtype) - 8
    weight = (values * scale.to(dtype).unsqueeze(-1)).view(out_features, -1)
    return weight[:, :in_features] if weight.shape[1] != in_features else weight


class QuantizedLinear(nn.Linear):
    """A frozen linear layer with an int8 or packed-int4 weight, dequantized in ``forward``.

    It is an ``nn.Linear`` to PEFT (which wraps it with LoRA, ``all-linear`` included). Its
    ``qweight`` (integers) and ``scale`` are frozen parameters, so sharding places and shards
    them like any other; ``weight`` names the integers, so code that would write into a float
    weight (merging an adapter into this layer) fails instead of silently doing nothing.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.compute_dtype = bits, group_size, dtype
        if bits == 8:
            q_shape, s_shape = (out_features, in_features), (out_features,)
            q_dtype = torch.int8
        else:
            groups = math.ceil(in_features / group_size)
            q_shape, s_shape = (out_features, groups * group_size // 2), (out_features, groups)
            q_dtype = torch.uint8
        self.qweight = nn.Parameter(torch.zeros(q_shape, dtype=q_dtype, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(s_shape, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def like(cls, linear: nn.Linear, bits: int, group_size: int, dtype: torch.dtype) -> QuantizedLinear:
        """An empty quantized twin of ``linear``, on the same device (``meta`` stays ``meta``)."""
        device = linear.weight.device
        return cls(linear.in_features, linear.out_features, linear.bias is not None, bits, group_size, dtype, device)

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision ``[out, in]`` weight into this layer (on the host)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} for a {self.out_features}x{self.in_features} layer"
            )
        q, scale = quantize_weight(weight, self.bits, self.group_size, self.compute_dtype)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_weight(
            self.qweight, self.scale, self.bits, self.group_size, self.in_features, dtype or self.compute_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _DequantizedLinear.apply(x, self.qweight, self.scale, bias, self)

    def dequantized_when(self, anchor: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight in ``anchor``'s dtype, as a value that depends on ``anchor``.

        Adding ``0 * anchor[0]`` to the scales (exact for finite values; compilers do not fold a
        float ``x * 0``) means the weight cannot be dequantized before the layer's input exists
        nor shared between the forward pass and its recomputation, so XLA neither hoists every
        layer's dequantization to the start of the step nor keeps it live until the backward pass.
        """
        scale = scale.to(anchor.dtype) + anchor.reshape(-1)[:1].detach() * 0
        return dequantize_weight(qweight, scale, self.bits, self.group_size, self.in_features, anchor.dtype)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}"


class _DequantizedLinear(torch.autograd.Function):
    """``x W^T + b`` with ``W`` dequantized when the layer runs, forward and backward.

    Only the integers and scales are saved for the backward pass (it dequantizes again), so no
    full-precision weight outlives its matmul, with or without activation checkpointing.
    """

    @staticmethod
    def forward(ctx, x, qweight, scale, bias, layer: QuantizedLinear):
        ctx.layer = layer
        ctx.save_for_backward(qweight, scale)
        return F.linear(x, layer.dequantized_when(x, qweight, scale), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        qweight, scale = ctx.saved_tensors
        return grad @ ctx.layer.dequantized_when(grad, qweight, scale), None, None, None, None


# ----------------------------------------------------------------------------- which layers


def quantized_names(model: nn.Module, lm_head: bool) -> list[str]:
    """Every ``nn.Linear`` of the decoder layers (and the LM head if asked), by module name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, QuantizedLinear):
            if module is head and not lm_head:
                continue
            names.append(name)
    return names


def check_quantizable(config: Any, lm_head: bool) -> None:
    """Refuse a quantized LM head that shares its weight with the input embedding."""
    if lm_head and getattr(config, "tie_word_embeddings", False):
        raise UserError(
            "model.quantize_lm_head: this model ties its LM head to the input embedding, which stays "
            "unquantized; set model.quantize_lm_head: false"
        )


def swap_linears(model: nn.Module, bits: int, group_size: int, lm_head: bool, dtype: torch.dtype) -> list[str]:
    """Replace the linears to quantize by empty ``QuantizedLinear``s (for a model on ``meta``)."""
    names = quantized_names(model, lm_head)
    for name in names:
        _replace(model, name, QuantizedLinear.like(model.get_submodule(name), bits, group_size, dtype))
    return names


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int, lm_head: bool = False) -> int:
    """Quantize a loaded model's linears in place, one at a time; returns how many were quantized."""
    names = quantized_names(model, lm_head)
    for name in names:
        linear = model.get_submodule(name)
        layer = QuantizedLinear.like(linear, BITS[method], group_size, linear.weight.dtype)
        layer.load_weight(linear.weight)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        _replace(model, name, layer)
    return len(names)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def logical_parameters(model: nn.Module) -> int:
    """Parameters of the model as if unquantized (a packed int4 byte holds two weights)."""
    stored = {id(p): p.numel() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            stored[id(module.qweight)] = module.in_features * module.out_features
            del stored[id(module.scale)]
    return sum(stored.values())
