"""Gemma 4 (E2B's layout shrunk, the multimodal checkpoint: ``families.GEMMA4``) against transformers: chunked
attention equals eager on left-padded and packed rows, and activation checkpointing keeps the gradients that
the layers reusing earlier layers' K/V send back to the layers that made them, on 4 XLA devices."""

from __future__ import annotations

import torch

from lowmem_tpu.config import ModelSection
from lowmem_tpu.model import attention, build_base_model


def _model(directory, implementation: str):
    cfg = ModelSection(name_or_path=str(directory), dtype="float32", attn_implementation=implementation)
    return build_base_model(cfg)


def _touch_xla():
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    return setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))


def test_chunked_attention_equals_eager_with_left_padding_and_packing(stand_ins, monkeypatch):
    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    torch.manual_seed(1)
    eager, chunked = _model(stand_ins["gemma4"], "eager"), _model(stand_ins["gemma4"], "chunked")
    ids = torch.randint(3, 500, (2, 29))  # past the window (8) on every sliding layer
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding, as generation batches have it
    expected, got = (m(input_ids=ids, attention_mask=mask).logits for m in (eager, chunked))
    real = mask.bool()
    assert (expected - got)[real].abs().max() <= 2e-5 * expected[real].abs().max()
    # Packed: two samples in one row (positions restart); each as eager computes it alone
    first, second = ids[0, :17], ids[1, 6:18]
    row = torch.cat([first, second])[None]
    segments = torch.tensor([[1] * 17 + [2] * 12])
    positions = torch.cat([torch.arange(17), torch.arange(12)])[None]
    packed = chunked(input_ids=row, segment_ids=segments, position_ids=positions).logits[0]
    alone = [eager(input_ids=sample[None]).logits[0] for sample in (first, second)]
    scale = max(a.abs().max() for a in alone)
    assert (packed - torch.cat(alone)).abs().max() <= 2e-5 * scale


def test_checkpointing_keeps_the_gradients_of_the_layers_whose_kv_is_reused(stand_ins):
    """Full fine-tuning, the shared K/V's producers' k_proj and v_proj included: checkpointing every layer and
    one in two gives the gradients of no checkpointing (torch_xla's reentrant checkpoint alone would cut them
    off: gradients off at every layer, a backward that raises at every_2)."""
    from lowmem_tpu.config import ShardingSection
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.xla.runtime import sync
    from lowmem_tpu.xla.sharding import place_parameters, wrap_model

    runtime = _touch_xla()
    torch.manual_seed(2)
    ids = torch.randint(3, 500, (4, 24))
    grads = {}
    for checkpointing in (False, True, "every_2"):
        model = _model(stand_ins["gemma4"], "chunked").requires_grad_(True)  # full fine-tuning
        place_parameters(model, runtime, "fsdp")
        names = ParamNames(model)  # the checkpoint's names, before wrapping renames the modules
        wrapped = wrap_model(model, ShardingSection(activation_checkpointing=checkpointing), runtime)
        batch = ids.to(runtime.device)
        wrapped(input_ids=batch, labels=batch).loss.backward()
        sync()
        grads[checkpointing] = {name: p.grad.cpu() for name, p in names.params.items() if p.grad is not None}
    plain = grads.pop(False)
    producers = [name for name in plain if ".layers.3.self_attn.k_proj" in name or ".layers.2.self_attn.v_proj" in name]
    assert len(producers) == 2  # the last sliding and the last full layer before the reusing ones
    for checkpointing, checkpointed in grads.items():
        assert plain.keys() == checkpointed.keys()
        for name, grad in plain.items():  # fp32 recomputation, relative to each gradient's scale
            assert (checkpointed[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-8, (checkpointing, name)
