"""A frozen int8, int4 or NF4 base for QLoRA training, in plain PyTorch that XLA compiles.

Each quantized projection keeps its packed weight and scales and dequantizes inside its forward
pass; the full-precision weight of one projection exists on each chip only while it is used. Under FSDP
(``gather``, set by the sharding code) an int8/int4 layer gathers its packed weight and scales whole before
dequantizing, so the all-gather moves the packed bytes. An NF4 layer gathers its block maxima only: each
chip dequantizes its own shard of the indices and the bf16 weight is gathered. The all-gather then moves 4x
the bytes, but each of N chips dequantizes 1/N of the weight, not all of it (docs/speed_calibration.md: the step by
libtpu's cost model, both ways).

- int8: symmetric, one scale per output row (``w ~ q * scale``, ``q`` in [-127, 127]).
- int4: symmetric, one scale per group of ``group_size`` inputs (``q`` in [-7, 7]), two
  values per byte in ``model.nibbles``' TPU layout. An input width that is not a multiple of the group
  is zero-padded to one, and the padding is sliced off after dequantizing.
- nf4: QLoRA's 4-bit NormalFloat with double quantization, bitsandbytes' arithmetic, laid out for the TPU
  (``model.nf4``).

int8/int4 scales are kept in the model's dtype; the integers are rounded against the stored scale,
so the scale's own rounding adds no error. ``model.build`` quantizes a checkpoint while it
is read, one tensor at a time, so the full-precision model never exists in memory as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowmem_tpu.config import ModelSection
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.nf4 import NF4Weight, dequantize_nf4, maxima_shape, quantize_nf4
from lowmem_tpu.model.nibbles import pack_halves, unpack_halves

QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class QuantSpec:
    """How a base is quantized: ``method`` int8 / int4 / nf4, inputs per scale, NF4's double quantization."""

    method: str
    group_size: int = 64
    double: bool = False

    @classmethod
    def of(cls, cfg: ModelSection) -> QuantSpec:
        double = cfg.quantize == "nf4" and cfg.quantize_double is not False
        return cls(cfg.quantize, cfg.quantize_group_size, double)

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype):
    """``(q, scale)`` of a 2-D weight: int8 ``[out, in]`` + ``[out]``, or for int4 uint8 packed in
    ``model.nibbles``' layout ``[padded_in / 2, out]`` + ``[out, padded_in / group_size]``."""
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
    return pack_halves((q.view(out_features, -1) + 8).to(torch.uint8)), scale  # 1..15; 8 is zero


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[out, in]`` weight in ``dtype`` (on whatever device ``q`` lives). int4 is computed as its
    transpose (``model.nibbles``' layout): a group is ``group_size`` consecutive rows of it, so a scale is
    broadcast along rows, not lanes, and the final transpose is a layout a matmul absorbs."""
    if bits == 8:
        return q.to(dtype) * scale.to(dtype).unsqueeze(-1)
    out_features = q.shape[1]
    values = torch.cat(unpack_halves(q)).to(dtype) - 8  # [padded in, out], exact in any float dtype
    scaled = (values.view(-1, group_size, out_features) * scale.to(dtype).t().unsqueeze(1)).view(-1, out_features)
    return scaled[:in_features].t().contiguous()


class QuantizedLinear(nn.Linear):
    """A frozen linear layer with a quantized weight, dequantized in ``forward``.

    It is an ``nn.Linear`` to PEFT (which wraps it with LoRA, ``all-linear`` included). Its
    ``qweight`` (packed integers) and ``scale`` (NF4: the block maxima) are frozen parameters, so
    sharding places and shards them like any other; NF4's second-level scales (``absmax2``,
    ``offset``) are small buffers, replicated. ``weight`` names the integers, so code that would
    write into a float weight (merging an adapter into this layer) fails instead of silently doing
    nothing. ``gather`` (unset unless the sharding code sets it) makes a tensor whole: the packed weight and scales
    (int8/int4), or the maxima and the dequantized weight (NF4).
    """

    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        spec: QuantSpec,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.spec, self.compute_dtype = spec, dtype
        q_shape, q_dtype, s_shape, s_dtype = _shapes(in_features, out_features, spec, dtype)
        self.qweight = nn.Parameter(torch.zeros(q_shape, dtype=q_dtype, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(s_shape, dtype=s_dtype, device=device), requires_grad=False)
        if spec.double:
            blocks = math.ceil(math.prod(s_shape) / 256)
            self.register_buffer("absmax2", torch.ones(blocks, dtype=torch.float32, device=device))
            self.register_buffer("offset", torch.zeros((), dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def like(cls, linear: nn.Linear, spec: QuantSpec, dtype: torch.dtype) -> QuantizedLinear:
        """An empty quantized twin of ``linear``, on the same device (``meta`` stays ``meta``)."""
        device = linear.weight.device
        return cls(linear.in_features, linear.out_features, linear.bias is not None, spec, dtype, device)

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
        spec = self.spec
        if spec.method == "nf4":
            nf4 = quantize_nf4(weight, spec.group_size, spec.double)
            q, scale = nf4.packed, nf4.absmax
            if spec.double:
                self.absmax2, self.offset = nf4.absmax2, nf4.offset
        else:
            q, scale = quantize_weight(weight, spec.bits, spec.group_size, self.compute_dtype)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight in ``dtype`` (default: the compute dtype), as training uses it."""
        return self._dequantize(self.qweight, self.scale, dtype or self.compute_dtype)

    def _dequantize(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        spec = self.spec
        if spec.method != "nf4":
            return dequantize_weight(qweight, scale, spec.bits, spec.group_size, self.in_features, dtype)
        second = (self.absmax2, self.offset) if spec.double else (None, None)
        return dequantize_nf4(NF4Weight(qweight, scale, *second), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _DequantizedLinear.apply(x, self.qweight, self.scale, bias, self)

    def dequantized_when(self, anchor: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight in ``anchor``'s dtype, as a value that depends on ``anchor``.

        Adding ``0 * anchor[0]`` (exact for finite values; compilers do not fold a float ``x * 0``)
        means the weight cannot be built before the layer's input exists nor shared between the forward
        pass and its recomputation, so XLA neither hoists every layer's weight to the start of the step
        nor keeps it live until the backward pass. Where the weight is gathered, or looked up (NF4), the
        anchor joins the packed bytes and scales before anything else, so neither the gathered bytes nor
        NF4's fp32 levels can be hoisted or shared; else (int8/int4 on one chip) it joins the scales.
        """
        zero = anchor.reshape(-1)[:1].detach() * 0
        spec = self.spec
        if self.gather is None and spec.method != "nf4":
            scale = scale.to(anchor.dtype) + zero
            return dequantize_weight(qweight, scale, spec.bits, spec.group_size, self.in_features, anchor.dtype)
        qweight, scale = qweight + zero.to(qweight.dtype), scale + zero.to(scale.dtype)
        if self.gather is not None:
            scale = self.gather(scale)
            qweight = qweight if spec.method == "nf4" else self.gather(qweight)
        if spec.method != "nf4":
            scale = scale.to(anchor.dtype)
            weight = dequantize_weight(qweight, scale, spec.bits, spec.group_size, self.in_features, anchor.dtype)
        else:
            second = (self.absmax2, self.offset) if spec.double else (None, None)
            weight = dequantize_nf4(NF4Weight(qweight, scale, *second), anchor.dtype)
        return weight if self.gather is None else self.gather(weight)

    def extra_repr(self) -> str:
        spec = self.spec
        group = "" if spec.method == "int8" else f", group_size={spec.group_size}"
        double = ", double_quant" if spec.double else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {spec.method}{group}{double}"


def _shapes(
    in_features: int, out_features: int, spec: QuantSpec, dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]:
    """``(qweight shape, its dtype, scale shape, its dtype)`` of a quantized layer."""
    if spec.method == "int8":
        return (out_features, in_features), torch.int8, (out_features,), dtype
    if spec.method == "int4":
        groups = math.ceil(in_features / spec.group_size)
        return (groups * spec.group_size // 2, out_features), torch.uint8, (out_features, groups), dtype
    if in_features % 2:
        raise UserError(
            f"model.quantize: nf4 packs two weights a byte along a row, and this model has a linear layer of "
            f"{in_features} inputs; use model.quantize: int4 (which pads a row) or int8"
        )
    maxima = torch.uint8 if spec.double else torch.float32
    return (
        (in_features // 2, out_features),  # model.nf4's layout: w's transpose, a row's two halves in a byte
        torch.uint8,
        maxima_shape(out_features, in_features, spec.group_size),
        maxima,
    )


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


def check_quantizable(config: Any, lm_head: bool, quantize: str) -> None:
    """Refuse a quantized LM head that shares its weight with the input embedding, and experts left unquantized."""
    from lowmem_tpu.config.features import quantize_refusal

    if reason := quantize_refusal(config, quantize):
        raise UserError(reason)
    if lm_head and getattr(config, "tie_word_embeddings", False):
        raise UserError(
            "model.quantize_lm_head: this model ties its LM head to the input embedding, which stays "
            "unquantized; set model.quantize_lm_head: false"
        )


def swap_linears(model: nn.Module, spec: QuantSpec, lm_head: bool, dtype: torch.dtype) -> list[str]:
    """Replace the linears to quantize by empty ``QuantizedLinear``s (for a model on ``meta``)."""
    names = quantized_names(model, lm_head)
    for name in names:
        _replace(model, name, QuantizedLinear.like(model.get_submodule(name), spec, dtype))
    return names


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantSpec, lm_head: bool = False) -> int:
    """Quantize a loaded model's linears in place, one at a time; returns how many were quantized."""
    names = quantized_names(model, lm_head)
    for name in names:
        linear = model.get_submodule(name)
        layer = QuantizedLinear.like(linear, spec, linear.weight.dtype)
        layer.load_weight(linear.weight)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        _replace(model, name, layer)
    return len(names)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``QuantizedLinear`` by an ``nn.Linear`` holding its dequantized weight: the model as
    training used it, which a merge folds the adapters into. Returns how many were replaced."""
    names = [name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    for name in names:
        layer = model.get_submodule(name)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
        linear.weight = nn.Parameter(layer.dequantized(dtype), requires_grad=False)
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
        _replace(model, name, linear)
    return len(names)


def logical_parameters(model: nn.Module) -> int:
    """Parameters of the model as if unquantized (a packed 4-bit byte holds two weights)."""
    stored = {id(p): p.numel() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            stored[id(module.qweight)] = module.in_features * module.out_features
            del stored[id(module.scale)]
    return sum(stored.values())
