"""NF4 with double quantization (``model.quantize: nf4``) against bitsandbytes, the reference: packed bytes,
block maxima, the second level and the dequantized weights equal bit for bit on the CPU (the XLA side, where
an FMA may move a maximum by one ulp: e2e/test_quantize_training.py)."""

from __future__ import annotations

import bitsandbytes.functional as bnb
import pytest
import torch

from lowmem_tpu.config import RecipeError, load_recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.nf4 import dequantize_nf4, dynamic_code, nf4_code, quantize_nf4, to_bitsandbytes
from lowmem_tpu.model.quantize import QuantizedLinear, QuantSpec


def _weight(shape: tuple[int, int], tails: bool, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Weight-like values: Gaussian, or heavy-tailed (Student-t, 3 degrees of freedom)."""
    generator = torch.Generator().manual_seed(seed)
    if tails:
        normal = torch.randn(shape, generator=generator)
        chi2 = torch.randn((3, *shape), generator=generator).pow(2).sum(0)
        values = normal / (chi2 / 3).sqrt()
    else:
        values = torch.randn(shape, generator=generator)
    return (values * 0.02).to(dtype)


def test_the_code_tables_are_bitsandbytes():
    assert torch.equal(nf4_code(), bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_code(), bnb.create_dynamic_map())


CASES = [
    ((256, 192), False, torch.bfloat16, 64, True),
    ((256, 192), False, torch.bfloat16, 64, False),
    ((3200, 8640), True, torch.bfloat16, 64, True),  # Open Llama 3B's down_proj: blocks of maxima cross rows
    ((96, 256), True, torch.float32, 32, True),
    ((96, 256), True, torch.float32, 32, False),
    ((64, 512), False, torch.bfloat16, 128, True),
    ((37, 256), True, torch.bfloat16, 256, True),  # 37 rows: the last block of maxima is short
    ((64, 172), False, torch.bfloat16, 64, True),  # the Open Llama stand-in's down_proj: blocks cross rows
    ((37, 100), True, torch.float32, 64, False),  # and a short last block of weights
    ((37, 100), True, torch.bfloat16, 64, True),
]


@pytest.mark.parametrize(
    ("shape", "tails", "dtype", "block", "double"), CASES, ids=[f"{c[0]}-{c[3]}-{c[4]}" for c in CASES]
)
def test_nf4_is_bitsandbytes_bit_for_bit(shape, tails, dtype, block, double):
    weight = _weight(shape, tails, dtype)
    packed, state = bnb.quantize_4bit(weight, blocksize=block, compress_statistics=double, quant_type="nf4")
    ours = quantize_nf4(weight, block, double)
    assert ours.packed.shape == (shape[1] // 2, shape[0]) and ours.packed.dtype == torch.uint8  # stored for the TPU
    assert ours.absmax.dim() == (2 if shape[1] % block == 0 else 1)
    assert torch.equal(to_bitsandbytes(ours.packed), packed.reshape(-1))
    assert torch.equal(ours.absmax.reshape(-1), state.absmax)
    if double:
        assert ours.absmax.dtype == torch.uint8
        assert torch.equal(ours.absmax2, state.state2.absmax)
        assert torch.equal(ours.offset, state.offset)
    assert torch.equal(dequantize_nf4(ours, dtype), bnb.dequantize_4bit(packed, state))


def test_products_in_bf16_would_change_values():
    """Why the dequantization stays in fp32 until one cast: bf16 products differ from bitsandbytes'."""
    weight = _weight((256, 256), False, torch.bfloat16)
    ours = quantize_nf4(weight, 64, True)
    exact = dequantize_nf4(ours, torch.bfloat16)
    levels = nf4_code()[torch.cat((ours.packed >> 4, ours.packed & 15)).t().long()]
    maxima = (
        bnb.dequantize_blockwise(ours.absmax.reshape(-1), absmax=ours.absmax2, code=dynamic_code(), blocksize=256)
        + ours.offset
    )
    in_bf16 = (levels.view(256, 4, 64).bfloat16() * maxima.view(256, 4, 1).bfloat16()).view(256, 256)
    assert (in_bf16 != exact).float().mean() > 0.05


def test_nf4_beats_int4_at_the_same_block():
    """NF4 + double quantization against the project's int4 at group 64, on Gaussian and heavy-tailed weights."""
    from lowmem_tpu.model.quantize import dequantize_weight, quantize_weight

    for tails in (False, True):
        weight = _weight((512, 1024), tails, torch.float32, seed=1)
        nf4 = dequantize_nf4(quantize_nf4(weight, 64, True), torch.float32)
        q, scale = quantize_weight(weight, 4, 64, torch.bfloat16)
        int4 = dequantize_weight(q, scale, 4, 64, 1024, torch.float32)
        assert (nf4 - weight).norm() < 0.95 * (int4 - weight).norm()


def test_quantized_linear_nf4_computes_with_bitsandbytes_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True)
    layer = QuantizedLinear.like(linear, QuantSpec("nf4", 64, True), torch.float32)
    layer.load_weight(linear.weight)
    layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    packed, state = bnb.quantize_4bit(linear.weight.detach(), blocksize=64, compress_statistics=True, quant_type="nf4")
    reference = bnb.dequantize_4bit(packed, state)
    assert torch.equal(layer.dequantized(torch.float32), reference)
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, reference, linear.bias))
    assert {n for n, _ in layer.named_buffers()} == {"absmax2", "offset"}
    assert not any(p.requires_grad for p in layer.parameters())
    assert "nf4, group_size=64, double_quant" in repr(layer)


def test_the_tpu_layout_holds_a_rows_two_halves_in_a_byte():
    """Byte [j, o] holds w[o, j] high and w[o, j + in/2] low: unpacking is elementwise, then whole rows."""
    weight = _weight((6, 8), False, torch.float32)
    ours = quantize_nf4(weight, 4, False)
    indices = torch.bucketize(
        (weight.view(-1, 4) / weight.view(-1, 4).abs().amax(-1, keepdim=True)).view(6, 8),
        (nf4_code()[:-1] + nf4_code()[1:]) / 2,
    )
    assert torch.equal(ours.packed >> 4, indices[:, :4].t().to(torch.uint8))
    assert torch.equal(ours.packed & 15, indices[:, 4:].t().to(torch.uint8))
    assert dequantize_nf4(ours, torch.float32).shape == (6, 8)


def test_nf4_refuses_an_odd_input_width():
    with pytest.raises(UserError, match=r"nf4 packs two weights a byte along a row, .* 95 inputs"):
        QuantizedLinear(95, 8, False, QuantSpec("nf4", 64, True), torch.float32)
    layer = QuantizedLinear(96, 8, False, QuantSpec("nf4", 64, True), torch.float32)  # blocks cross rows
    assert layer.scale.shape == (12,) and layer.absmax2.shape == (1,)


def test_recipe_nf4_fields():
    recipe = load_recipe(None, ["model.quantize=nf4"])
    assert QuantSpec.of(recipe.model) == QuantSpec("nf4", 64, True)
    assert QuantSpec.of(load_recipe(None, ["model.quantize=nf4", "model.quantize_double=false"]).model).double is False
    with pytest.raises(RecipeError, match=r"model\.quantize_double: double quantization is NF4's"):
        load_recipe(None, ["model.quantize=int4", "model.quantize_double=true"])
    assert QuantSpec.of(load_recipe(None, ["model.quantize=int4"]).model).double is False


def test_nf4_weight_round_trips_through_a_state_dict():
    weight = _weight((64, 128), False, torch.float32)
    layer = QuantizedLinear(128, 64, False, QuantSpec("nf4", 64, True), torch.float32)
    layer.load_weight(weight)
    twin = QuantizedLinear(128, 64, False, QuantSpec("nf4", 64, True), torch.float32)
    twin.load_state_dict(layer.state_dict())
    assert torch.equal(twin.dequantized(), layer.dequantized())
    assert torch.equal(twin.offset, layer.offset) and twin.scale.dtype == torch.uint8


def test_loftq_is_refused_with_the_reason():
    with pytest.raises(RecipeError, match=r"LoftQ computes on CUDA or XPU only"):
        load_recipe(None, ["model.quantize=nf4", "lora.init_lora_weights=loftq"])
