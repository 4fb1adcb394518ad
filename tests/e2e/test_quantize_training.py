"""The int8 / int4 frozen base (``model.quantize``) on the XLA devices: the backward, and training on it
(numerics and loading: unit/test_quantize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quantized import load_quantized
from tiny_models import train_tiny
from transformers import AutoModelForCausalLM

from lowmem_tpu.model.quantize import QuantizedLinear, QuantSpec


def test_backward_dequantizes_again_and_saves_no_float_weight():
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    # On the XLA devices, as in training (a CPU backward first would start autograd without them).
    device = setup_runtime(RuntimeSection()).device
    torch.manual_seed(0)
    layer = QuantizedLinear(64, 32, bias=False, spec=QuantSpec("int8"), dtype=torch.float32)
    layer.load_weight(torch.randn(32, 64))
    layer.to(device)
    x = torch.randn(5, 64, device=device, requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).pow(2).sum().backward()
    torch.nn.functional.linear(reference, layer.dequantized()).pow(2).sum().backward()
    assert torch.allclose(x.grad.cpu(), reference.grad.cpu(), atol=1e-5)
    assert all(t.dtype in (torch.int8, torch.uint8) or t.shape != (32, 64) for t in saved)


def test_nf4_on_the_xla_device_is_bitsandbytes_within_one_fp32_ulp():
    """XLA may fuse ``code2[q] * absmax2 + offset`` into one FMA: a double-quantized block maximum can land
    one fp32 ulp from bitsandbytes' (the CPU's separate multiply and add are exact: unit/test_nf4.py), and
    its block's weights within two (the product rounds again). Single quantization has no such sum."""
    import bitsandbytes.functional as bnb

    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.model.nf4 import NF4Weight, block_maxima
    from lowmem_tpu.xla.runtime import setup_runtime

    device = setup_runtime(RuntimeSection()).device
    weight = torch.randn(384, 512, generator=torch.Generator().manual_seed(0)) * 0.02

    def ulps(ours: torch.Tensor, reference: torch.Tensor) -> float:
        spacing = torch.finfo(torch.float32).eps * reference.abs()
        return float(((ours - reference).abs() / spacing.clamp(min=torch.finfo(torch.float32).tiny)).max())

    for double in (True, False):
        layer = QuantizedLinear(512, 384, bias=False, spec=QuantSpec("nf4", 64, double), dtype=torch.float32)
        layer.load_weight(weight)
        packed, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=double, quant_type="nf4")
        maxima = state.absmax
        if double:
            maxima = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
        layer.to(device)
        second = (layer.absmax2, layer.offset) if double else (None, None)
        on_xla = block_maxima(NF4Weight(layer.qweight, layer.scale, *second)).cpu().reshape(-1)
        assert ulps(on_xla, maxima) <= (1.0 if double else 0.0)
        assert ulps(layer.dequantized(torch.float32).cpu(), bnb.dequantize_4bit(packed, state)) <= (
            2.0 if double else 0
        )


# ----------------------------------------------------------------------------- training on 4 CPU XLA devices

QUICK = [
    "train.max_steps=18",
    "train.logging_steps=6",
    "train.eval_steps=null",
    "train.eval_samples=0",
    "train.global_batch_size=32",
]


def _sft(tmp_path_factory, name: str, *overrides: str):
    return train_tiny(tmp_path_factory, name, *QUICK, *overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bases):
    """The same LoRA run on the float base (a local checkpoint) and on its int8, int4 and nf4 versions."""
    local = [f"model.name_or_path={bases['safetensors']}", "model.random_init=false"]
    return {
        method: _sft(tmp_path_factory, method, *local, f"model.quantize={method}", "model.quantize_group_size=32")
        for method in ("none", "int8", "int4", "nf4")
    }


@pytest.mark.slow
def test_losses_match_the_full_precision_base(trained):
    losses = {m: [e["loss"] for e in run.metrics["train"]["losses"]] for m, (_, run) in trained.items()}
    assert len(losses["none"]) == 3 and losses["none"][-1] < losses["none"][0] - 0.2, losses  # it learns
    # Measured at 30 steps: every logged loss within 0.4% (int8) and 0.2% (int4) of the float base's.
    for method, tolerance in (("int8", 0.01), ("int4", 0.02), ("nf4", 0.02)):
        for a, b in zip(losses["none"], losses[method], strict=True):
            assert b == pytest.approx(a, rel=tolerance), (method, losses)
    for _, run in trained.values():
        assert run.metrics["compiles"]["after_warmup"] == 0
        assert run.metrics["total_parameters"] == trained["none"][1].metrics["total_parameters"]


@pytest.mark.slow
def test_quantized_base_is_sharded_frozen_and_untouched(trained, bases):
    from lowmem_tpu.xla.device import sharding_spec

    _, run = trained["int4"]
    params = run.names.params
    qweight = params["base_model.model.model.layers.0.mlp.down_proj.base_layer.qweight"]
    assert qweight.dtype == torch.uint8 and not qweight.requires_grad
    assert sharding_spec(qweight).startswith("{devices=[4,1]")  # [128, 128 packed]: split on dim 0
    fresh = load_quantized(bases["safetensors"], "int4", 32, False)
    fresh_state = fresh.state_dict()
    for name, value in run.names.host_state().items():
        if "lora_" not in name:
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(value, fresh_state[key]), f"base tensor {name} changed"


@pytest.mark.slow
def test_nf4_base_is_packed_and_sharded_with_its_second_level_replicated(trained):
    from lowmem_tpu.xla.device import sharding_spec

    trainer = trained["nf4"][1].trainer
    layer = next(m for m in trainer.fsdp_model.modules() if isinstance(m, QuantizedLinear))
    assert layer.qweight.dtype == torch.uint8 and layer.scale.dtype == torch.uint8  # double quantized maxima
    assert layer.qweight.shape == (layer.in_features // 2, layer.out_features)  # model.nf4's TPU layout
    assert sharding_spec(layer.qweight).startswith(("{devices=[4,1]", "{devices=[1,4]"))  # its largest dim
    assert sharding_spec(layer.absmax2) in ("", "{replicated}")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4", "nf4"])
def test_adapter_is_a_normal_peft_adapter_for_the_unquantized_base(trained, bases, method, tmp_path):
    from peft import PeftModel

    from lowmem_tpu.publish.merge import merge_adapter

    _, run = trained[method]
    config = json.loads((run.final_dir / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == Path(bases["safetensors"]).resolve()
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, run.final_dir).eval()
    ids = torch.tensor(run.trainer.eval_dataset[:8]["input_ids"])
    with torch.no_grad():
        on_quantized = run.trainer.fsdp_model.eval()(input_ids=ids.to(run.trainer.runtime.device)).logits.cpu()
        on_full = reloaded(input_ids=ids).logits
    # The adapter learnt on the quantized base behaves alike on the full-precision one.
    assert on_full.argmax(-1).eq(on_quantized.argmax(-1)).float().mean() > (0.95 if method == "int8" else 0.8)
    # Merged as trained (the default): into the dequantized weights, equal to the quantized base + adapter.
    merged = merge_adapter(run.final_dir, tmp_path / "merged", dtype="float32")
    assert merged.check["passed"] and merged.check["against"] == f"{method} base + adapter", merged.check
    as_trained = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(as_trained(input_ids=ids).logits, on_quantized, atol=1e-4, rtol=1e-4)
    # Into the original weights (--original-weights): checked against them + adapter, a different model.
    original = merge_adapter(run.final_dir, tmp_path / "original", dtype="float32", original_weights=True)
    assert original.check["passed"] and original.check["against"] == "base + adapter", original.check
