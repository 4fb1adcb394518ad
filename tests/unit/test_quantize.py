"""The int8 / int4 frozen base (``model.quantize``): numerics and loading one tensor at a time (the backward
on the XLA devices and training on it: e2e/test_quantize_training.py)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from quantized import load_quantized
from tiny_models import make_base
from transformers import AutoConfig, AutoModelForCausalLM

from lowmem_tpu.config import RecipeError, load_recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.quantize import (
    QuantizedLinear,
    QuantSpec,
    dequantize_weight,
    logical_parameters,
    quantize_model,
    quantize_weight,
)


@pytest.mark.parametrize(
    ("bits", "group", "shape", "bound"),
    [(8, 64, (96, 160), 0.01), (4, 32, (96, 160), 0.15), (4, 128, (64, 200), 0.15), (4, 64, (8, 66), 0.15)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_what_the_bit_width_allows(bits, group, shape, bound, dtype):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    q, scale = quantize_weight(weight, bits, group, dtype)
    back = dequantize_weight(q, scale, bits, group, shape[1], torch.float32)
    assert back.shape == weight.shape
    # No element is further from its value than half a quantization step of its row or group.
    step = scale.to(torch.float32)
    step = step.unsqueeze(-1) if bits == 8 else step.repeat_interleave(group, dim=1)[:, : shape[1]]
    assert ((back - weight).abs() <= step / 2 + 1e-7).all()
    assert (back - weight).norm() / weight.norm() < bound
    groups = math.ceil(shape[1] / group)
    if bits == 8:
        assert q.dtype == torch.int8 and q.shape == shape and scale.shape == (shape[0],)
    else:  # two values per byte, the input padded to whole groups
        assert q.dtype == torch.uint8 and q.shape == (groups * group // 2, shape[0])  # model.nibbles' layout
        assert scale.shape == (shape[0], groups)
    assert scale.dtype == dtype


def test_int4_packs_a_rows_two_halves_in_a_byte_and_keeps_zero_exact():
    """model.nibbles' layout: ``[in / 2, out]``, byte ``[j, o]`` = index ``j`` (high) and ``j + in / 2`` (low)."""
    weight = torch.zeros(2, 32)
    weight[0, :4] = torch.tensor([7.0, -7.0, 0.0, 1.0])
    weight[0, 16], weight[1, 17] = -3.0, 2.0
    q, scale = quantize_weight(weight, 4, 32, torch.float32)
    assert q.shape == (16, 2) and torch.allclose(scale, torch.tensor([[1.0], [2 / 7]]))
    assert q[0, 0].item() == ((7 + 8) << 4) | (-3 + 8)
    assert q[1, 0].item() == ((-7 + 8) << 4) | 8
    assert q[3, 0].item() == ((1 + 8) << 4) | 8
    assert q[1, 1].item() == (8 << 4) | (7 + 8) and q[0, 1].item() == (8 << 4) | 8
    assert torch.equal(dequantize_weight(q, scale, 4, 32, 32, torch.float32)[0], weight[0])
    assert torch.allclose(dequantize_weight(q, scale, 4, 32, 32, torch.float32), weight)


def test_quantized_linear_is_a_frozen_linear_that_peft_wraps():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    layer = QuantizedLinear.like(linear, QuantSpec("int4", 32), torch.float32)
    layer.load_weight(linear.weight)
    layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
    assert torch.allclose(layer(x), expected)
    assert not any(p.requires_grad for p in layer.parameters())
    model = torch.nn.Sequential()
    model.add_module("proj", layer)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert peft.base_model.model.proj.base_layer is layer
    assert [n for n, p in peft.named_parameters() if p.requires_grad] == [
        "base_model.model.proj.lora_A.default.weight",
        "base_model.model.proj.lora_B.default.weight",
    ]
    assert torch.allclose(peft(x), expected)  # LoRA B starts at zero


@pytest.mark.parametrize("layout", ["safetensors", "bin", "sharded"])
@pytest.mark.parametrize(("method", "group"), [("int8", 64), ("int4", 32), ("nf4", 32)])
def test_loading_quantizes_each_tensor_as_read_same_as_quantizing_the_loaded_model(bases, layout, method, group):
    path = bases[layout]
    streamed = load_quantized(path, method, group, False)
    reference, full_logits_model = (
        AutoModelForCausalLM.from_pretrained(bases["safetensors"], dtype=torch.float32, attn_implementation="eager")
        for _ in range(2)
    )
    assert quantize_model(reference, QuantSpec(method, group, method == "nf4")) == 4 * 7
    assert isinstance(streamed.model.layers[3].mlp.down_proj, QuantizedLinear)
    assert type(streamed.lm_head) is torch.nn.Linear  # the head stays in full precision by default
    state = dict(streamed.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    ids = torch.randint(3, 48, (2, 12))
    with torch.no_grad():
        quantized, full = streamed(ids).logits, full_logits_model(ids).logits
    assert torch.equal(quantized, reference(ids).logits)
    assert (quantized - full).abs().max() < (0.05 if method == "int8" else 0.5)
    assert logical_parameters(streamed) == sum(p.numel() for p in full_logits_model.parameters())


def test_quantized_lm_head_and_a_refused_tied_head(bases, tmp_path):
    from lowmem_tpu.model.quantize import check_quantizable

    model = load_quantized(bases["safetensors"], "int8", 64, True)
    assert isinstance(model.lm_head, QuantizedLinear)
    tied = make_base(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(UserError, match="quantize_lm_head: this model ties its LM head"):
        check_quantizable(AutoConfig.from_pretrained(tied), lm_head=True, quantize="int8")
    check_quantizable(AutoConfig.from_pretrained(tied), lm_head=False, quantize="int8")
    model = load_quantized(tied, "int4", 32, False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_directory_without_weights_or_with_missing_ones_is_refused(bases, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"holds no model\.safetensors or pytorch_model\.bin"):
        load_quantized(tmp_path / "empty", "int8", 64, False)
    from safetensors.torch import load_file, save_file

    state = load_file(str(bases["safetensors"] / "model.safetensors"))
    del state["model.layers.2.mlp.up_proj.weight"]
    (tmp_path / "partial").mkdir()
    save_file(state, str(tmp_path / "partial" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(bases["safetensors"] / "config.json", tmp_path / "partial")
    with pytest.raises(UserError, match=r"lacks weights for 2 parameters \(first: model\.layers\.2\.mlp\.up_proj"):
        load_quantized(tmp_path / "partial", "int8", 64, False)


def test_recipe_refuses_quantizing_a_fully_fine_tuned_base():
    with pytest.raises(RecipeError, match=r"model\.quantize: int4 freezes the base .* set lora\.enabled: true"):
        load_recipe(None, ["model.quantize=int4", "lora.enabled=false"])
    with pytest.raises(RecipeError, match=r"not supported with sharding\.scan_layers yet"):
        load_recipe(None, ["model.quantize=int8", "sharding.scan_layers=true"])
    assert load_recipe(None, ["model.quantize=null"]).model.quantize == "none"
    with pytest.raises(RecipeError, match="quantize_group_size"):
        load_recipe(None, ["model.quantize=int4", "model.quantize_group_size=100"])
