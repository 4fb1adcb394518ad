"""The matmul rotation (``model.rope``) on the XLA devices, in bfloat16 as runs train: logits and gradients
equal to the family's own slices, traced and run by XLA (the CPU-eager check of every family:
unit/test_rope.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowmem_tpu.model.rope import _ORIGINAL, use_matmul_rotation


def _forward_backward(model, ids, device):
    model.zero_grad()
    out = model(input_ids=ids.to(device), labels=ids.to(device))
    out.loss.backward()
    from lowmem_tpu.xla.runtime import sync

    sync()  # one program for every gradient, not one per .cpu() below
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if "self_attn" in n}  # q and k rotate
    return out.logits.cpu(), grads


@pytest.mark.parametrize("name", ["llama3", "phi3"])
def test_the_matmul_rotation_runs_the_same_on_xla_in_bf16(stand_ins, name):
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))
    model = AutoModelForCausalLM.from_pretrained(stand_ins[name], dtype=torch.bfloat16).to(runtime.device)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    logits, grads = _forward_backward(model, ids, runtime.device)
    swapped = use_matmul_rotation(model)
    try:
        assert swapped
        logits_mm, grads_mm = _forward_backward(model, ids, runtime.device)
    finally:
        for module in map(sys.modules.get, swapped):
            module.rotate_half = getattr(module, _ORIGINAL)
            delattr(module, _ORIGINAL)
    assert torch.equal(logits_mm, logits)
    assert grads and all(torch.equal(grads_mm[n], g) for n, g in grads.items())
