"""A mixture-of-experts model (Qwen 3 MoE's layout shrunk: ``families.py``) through a real run on 4 XLA
devices: LoRA on its experts trains with a fixed set of programs and no operation left to the host, the
merge passes its check and transformers loads the result; and activation checkpointing keeps every
gradient of full fine-tuning (the static experts against transformers' own: unit/test_experts.py)."""

from __future__ import annotations

import json

import torch
from cli_runs import command_cli
from transformers import AutoModelForCausalLM

from lowmem_tpu.config import ModelSection, RuntimeSection, ShardingSection
from lowmem_tpu.model import build_base_model


def test_lora_on_the_experts_trains_on_xla_and_merges(stand_ins, tmp_path):
    out, merged = tmp_path / "run", tmp_path / "merged"
    run = command_cli(
        "sft",
        "recipes/tiny_lora_cpu.yaml",
        f"model.name_or_path={stand_ins['qwen3_moe']}",
        "model.random_init=false",
        f"output_dir={out}",
        "model.attn_implementation=chunked",
        "sharding.activation_checkpointing=every_2",
        "train.max_steps=4",
        "data.max_samples=512",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    assert metrics["compiles"]["after_warmup"] == 0 and metrics["compiles"]["cpu_fallbacks"] == []
    assert metrics["eval"]["after"]["loss"] < metrics["eval"]["before"]["loss"]
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    merge = command_cli("merge", str(out / "final"), "--out", str(merged), "--dtype", "float32")
    assert merge.returncode == 0 and "logits match" in merge.stdout, merge.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(stand_ins["qwen3_moe"], dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    changed = {name for name in base if not torch.equal(base[name], loaded[name])}
    assert changed and all(".experts." in n or "self_attn" in n for n in changed)
    assert any(".experts.down_proj" in n for n in changed)


def test_checkpointing_keeps_every_gradient_of_the_experts(stand_ins):
    """Full fine-tuning: checkpointing every layer and one in two gives the gradients of no checkpointing."""
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.xla.runtime import setup_runtime, sync
    from lowmem_tpu.xla.sharding import place_parameters, wrap_model

    runtime = setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(2))
    grads = {}
    for checkpointing in (False, True, "every_2"):
        cfg = ModelSection(name_or_path=str(stand_ins["qwen3_moe"]), dtype="float32", attn_implementation="chunked")
        model = build_base_model(cfg).requires_grad_(True)
        place_parameters(model, runtime, "fsdp")
        names = ParamNames(model)
        wrapped = wrap_model(model, ShardingSection(activation_checkpointing=checkpointing), runtime)
        batch = ids.to(runtime.device)
        wrapped(input_ids=batch, labels=batch).loss.backward()
        sync()
        grads[checkpointing] = {name: p.grad.cpu() for name, p in names.params.items() if p.grad is not None}
    plain = grads.pop(False)
    assert sum(".experts." in name for name in plain) == 4 and any(".mlp.gate." in name for name in plain)
    for checkpointing, checkpointed in grads.items():
        assert plain.keys() == checkpointed.keys()
        for name, grad in plain.items():
            assert (checkpointed[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-8, (checkpointing, name)
