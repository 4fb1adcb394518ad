"""Chunked attention as eager attention computes it on the families that window or soft-cap attention, logits
and gradients, in fp32 and bf16, with XLA started first as every run starts it (the rest of each family against
transformers: unit/test_families.py).
The stand-ins (``stand_ins``, tests/conftest.py) are each family's config shrunk, with random weights."""

from __future__ import annotations

import pytest
import torch
from families import WINDOW
from transformers import AutoModelForCausalLM

from lowmem_tpu.model import attention


def _touch_xla() -> None:
    """XLA started as every run starts it before any CPU backward (after one, XLA backwards in this process fail)."""
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))


def _logits_and_grads(directory, implementation: str, ids, mask, dtype=torch.float32):
    attention.register(implementation)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attention.transformers_name(implementation)
    )
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral", "phi3", "qwen3", "gpt_oss"])  # gpt-oss: sinks
def test_chunked_attention_equals_eager_past_the_window(stand_ins, name, monkeypatch):
    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    torch.manual_seed(1)
    ids = torch.randint(3, 500, (2, 4 * WINDOW + 5))  # rows four windows long: blocks of 8 and a ragged one
    mask = torch.ones_like(ids)
    mask[1, 3 * WINDOW :] = 0  # right padding, as the data rows have it
    eager, eager_grads = _logits_and_grads(stand_ins[name], "eager", ids, mask)
    chunked, chunked_grads = _logits_and_grads(stand_ins[name], "chunked", ids, mask)
    real = mask.bool()
    assert (eager - chunked)[real].abs().max() <= 2e-5 * eager[real].abs().max()
    for key, grad in eager_grads.items():  # fp32 summation order, relative to each gradient's scale
        assert (grad - chunked_grads[key]).abs().max() <= 2e-5 * grad.abs().max() + 1e-8, key


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_chunked_attention_equals_eager_in_bf16(stand_ins, name, monkeypatch):
    """The training dtype: equal within bf16 rounding (eager rounds its probabilities to bf16, chunked keeps fp32)."""
    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    torch.manual_seed(1)
    ids = torch.randint(3, 500, (2, 4 * WINDOW + 5))
    mask = torch.ones_like(ids)
    mask[1, 3 * WINDOW :] = 0
    eager, _ = _logits_and_grads(stand_ins[name], "eager", ids, mask, torch.bfloat16)
    chunked, _ = _logits_and_grads(stand_ins[name], "chunked", ids, mask, torch.bfloat16)
    real = mask.bool()
    error = (eager.float() - chunked.float())[real].abs().max() / eager.float()[real].abs().max()
    assert error < 2e-2, error
