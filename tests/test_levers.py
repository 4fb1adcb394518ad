"""Memory levers that change the step's arithmetic: chunked attention equals eager attention, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lowmem_tpu.config import load_recipe
from lowmem_tpu.model import attention


def _touch_xla() -> None:
    import torch_xla

    torch_xla.device()  # before any CPU backward: after one, XLA backwards fail in this process (XLA_NOTES)


def _tiny(impl: str, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    attention.register(impl)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=impl,
    )  # head size 10 (not a multiple of anything), grouped-query attention
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _run(model, ids, mask, device):
    model = model.to(device)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
    out.loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    return out.logits.detach().cpu(), out.loss.detach().cpu(), grads


@pytest.fixture
def batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (3, 37))  # 37 keys: blocks of 8, 8, 8, 8 and 5
    mask = torch.ones(3, 37, dtype=torch.long)
    mask[1, 30:] = 0  # right padding, as the data rows have it
    mask[2, 20:] = 0
    return ids, mask


def test_chunked_attention_equals_eager_outputs_and_gradients(batch, monkeypatch):
    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    ids, mask = batch
    (el, eloss, eg), (cl, closs, cg) = (_run(_tiny(impl), ids, mask, "cpu") for impl in ("eager", "chunked"))
    real = mask.bool()
    assert (el - cl)[real].abs().max() < 1e-5 and abs(eloss - closs) < 1e-6
    for name in eg:  # tolerance: fp32 summation order, relative to each gradient's scale
        assert (eg[name] - cg[name]).abs().max() <= 1e-5 * eg[name].abs().max() + 1e-8, name


def test_chunked_attention_on_the_xla_devices_equals_eager_on_the_cpu(batch, monkeypatch):
    import torch_xla

    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 32)  # two blocks: one full, one partial
    ids, mask = batch
    el, eloss, eg = _run(_tiny("eager", layers=1), ids, mask, "cpu")
    xl, xloss, xg = _run(_tiny("chunked", layers=1), ids, mask, torch_xla.device())
    assert (el - xl)[mask.bool()].abs().max() < 1e-4 and abs(eloss - xloss) < 1e-5
    assert all((eg[n] - xg[n]).abs().max() <= 1e-4 * eg[n].abs().max() + 1e-7 for n in eg)


def test_a_query_that_sees_nothing_gives_zeros_not_nan():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    padding = torch.tensor([[0, 0, 1, 1]])  # left padding: the first two queries see no key
    out = attention.ChunkedAttention.apply(q, k, v, padding, 8**-0.5, 2)
    assert torch.isfinite(out).all() and (out[0, :, :2] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_flash_is_refused_off_a_tpu_with_the_alternative():
    from lowmem_tpu.config import RecipeError

    with pytest.raises(RecipeError, match=r"flash is torch_xla's Pallas TPU kernel.*use chunked"):
        load_recipe("recipes/tiny_lora_cpu.yaml", ["model.attn_implementation=flash"])


@pytest.mark.tpu
@pytest.mark.skipif(__import__("os").environ.get("PJRT_DEVICE", "CPU").upper() != "TPU", reason="needs a TPU")
def test_flash_attention_on_a_tpu_equals_eager():  # pragma: no cover - TPU only
    """The Pallas kernel under SPMD, head size 10 padded to 128 lanes; right padding is exact for real tokens."""
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="tpu"))
    n = runtime.num_devices  # the batch is split over the fsdp axis
    torch.manual_seed(1)
    ids, mask = torch.randint(0, 50, (n, 64)), torch.ones(n, 64, dtype=torch.long)
    mask[0, 40:] = 0
    el, eloss, eg = _run(_tiny("eager", layers=1), ids, mask, "cpu")
    fl, floss, fg = _run(_tiny("flash", layers=1), ids, mask, runtime.device)
    assert (el - fl)[mask.bool()].abs().max() < 2e-2 and abs(eloss - floss) < 1e-2  # the kernel computes in bf16
    assert all((eg[n] - fg[n]).abs().max() <= 5e-2 * eg[n].abs().max() + 1e-5 for n in eg)
