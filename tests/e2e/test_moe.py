"""Mixture-of-experts models (Qwen 3 MoE's and gpt-oss's layouts shrunk: ``families.py``) through a real run
on 4 XLA devices: LoRA on its experts trains with a fixed set of programs and no operation left to the host, the
merge passes its check and transformers loads the result; and activation checkpointing keeps every
gradient of full fine-tuning (the static experts against transformers' own: unit/test_experts.py)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runs import command_cli
from transformers import AutoModelForCausalLM

from lowmem_tpu.config import ModelSection, RuntimeSection, ShardingSection
from lowmem_tpu.model import build_base_model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # gpt-oss: MXFP4 experts read, sinks, biases
def test_lora_on_the_experts_trains_on_xla_and_merges(stand_ins, tmp_path, family):
    out, merged = tmp_path / "run", tmp_path / "merged"
    run = command_cli(
        "sft",
        "recipes/tiny_lora_cpu.yaml",
        f"model.name_or_path={stand_ins[family]}",
        "model.random_init=false",
        f"output_dir={out}",
        "model.attn_implementation=chunked",
        "sharding.activation_checkpointing=every_2",
        "train.max_steps=4",
        "data.max_samples=512",
        f"data.max_length={48 if family == 'gpt_oss' else 24}",  # harmony's system message
        # gpt-oss's own weight, 0.9, adds about 1.9 of load-balancing loss to the stand-in's cross-entropy
        *(["train.router_aux_loss_coef=0"] if family == "gpt_oss" else []),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    assert metrics["compiles"]["after_warmup"] == 0 and metrics["compiles"]["cpu_fallbacks"] == []
    assert metrics["eval"]["after"]["loss"] < metrics["eval"]["before"]["loss"]
    assert family != "gpt_oss" or metrics["eval"]["before"]["loss"] < 7.0  # cross-entropy alone (8.3 with it)
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    # bf16: the merge check upcasts PEFT's wrapped stacks too (a bf16 merge of the gpt-oss stand-in's adapter
    # measured 7.3e-2 against the check's 5e-2, unexplained: it is refused, as the check is there to do)
    for dtype in ("float32", "bfloat16") if family == "qwen3_moe" else ("float32",):
        merge = command_cli("merge", str(out / "final"), "--out", str(merged / dtype), "--dtype", dtype)
        assert merge.returncode == 0 and "logits match" in merge.stdout, merge.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(stand_ins[family], dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(merged / "float32", dtype=torch.float32).state_dict()
    changed = {name for name in base if not torch.equal(base[name], loaded[name])}
    assert changed and all(".experts." in n or "self_attn" in n for n in changed)
    assert any(".experts.down_proj" in n for n in changed)


def test_checkpointing_and_the_sharded_kernel_keep_every_gradient_of_full_fine_tuning(stand_ins):
    """On 4 XLA devices, against the reference experts without checkpointing: checkpointing every layer and one
    in two, and xla.experts' manual sharding and backward (the rows' gradient, the stack's summed over
    devices) with the kernels' contract in plain torch (megablox's run on a TPU only: the TPU compiler
    compiles them in e2e/test_tpu_only_paths.py): the same logits and gradients; and the kernel on tokens the
    devices do not divide (one shard, computed on each device) gives the reference's logits."""
    from lowmem_tpu.model import experts
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.xla import experts as xla_experts
    from lowmem_tpu.xla.runtime import setup_runtime, sync
    from lowmem_tpu.xla.sharding import place_parameters, wrap_model

    runtime = setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(2))
    sharded = xla_experts.sharded_kernel(xla_experts.local_gmm, xla_experts.local_tgmm)
    results = {}
    try:
        for name, checkpointing, kernel in (
            ("plain", False, None),
            ("every layer", True, None),
            ("every_2", "every_2", None),
            ("sharded kernel", False, sharded),
        ):
            experts.provide_kernel(kernel, runtime.num_devices)
            cfg = ModelSection(name_or_path=str(stand_ins["qwen3_moe"]), dtype="float32", attn_implementation="chunked")
            model = build_base_model(cfg).requires_grad_(True)
            place_parameters(model, runtime, "fsdp")
            names = ParamNames(model)
            wrapped = wrap_model(model, ShardingSection(activation_checkpointing=checkpointing), runtime)
            batch = ids.to(runtime.device)
            out = wrapped(input_ids=batch, labels=batch)
            out.loss.backward()
            sync()
            grads = {n: p.grad.cpu() for n, p in names.params.items() if p.grad is not None}
            results[name] = (out.logits.detach().cpu(), grads)
            if kernel is not None:  # 15 tokens, which 4 devices do not divide: one shard, computed on each
                odd = ids[:1, :15].to(runtime.device)
                results["one shard"] = (wrapped(input_ids=odd).logits.detach().cpu(), None)
                experts.provide_kernel(None, runtime.num_devices)
                results["one shard, reference"] = (wrapped(input_ids=odd).logits.detach().cpu(), None)
    finally:
        experts.provide_kernel(None, runtime.num_devices)
    odd, _ = results.pop("one shard")
    odd_reference, _ = results.pop("one shard, reference")
    assert (odd - odd_reference).abs().max() <= 1e-5 * odd_reference.abs().max()
    reference, plain = results.pop("plain")
    assert sum(".experts." in name for name in plain) == 4 and any(".mlp.gate." in name for name in plain)
    for name, (logits, grads) in results.items():
        assert (logits - reference).abs().max() <= 1e-5 * reference.abs().max(), name
        assert plain.keys() == grads.keys()
        for param, grad in plain.items():
            assert (grads[param] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-8, (name, param)


@pytest.mark.tpu
def test_megablox_grouped_matmuls_on_a_tpu_equal_the_reference(stand_ins):  # pragma: no cover - TPU only
    """The TPU kernel (gmm, tgmm) under SPMD against the reference, logits and every gradient, in fp32."""
    from lowmem_tpu.model import experts
    from lowmem_tpu.xla.runtime import setup_runtime, sync
    from lowmem_tpu.xla.sharding import place_parameters

    runtime = setup_runtime(RuntimeSection(device="tpu"))  # installs the kernel
    kernel = experts._kernel
    ids = torch.randint(3, 500, (runtime.num_devices, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for provided in (None, kernel):
        experts.provide_kernel(provided, runtime.num_devices)
        model = build_base_model(ModelSection(name_or_path=str(stand_ins["qwen3_moe"]), dtype="float32"))
        model.requires_grad_(True)
        place_parameters(model, runtime, "fsdp")
        batch = ids.to(runtime.device)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        sync()
        results.append((out.logits.cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}))
    (reference, expected), (logits, grads) = results
    assert (logits - reference).abs().max() <= 1e-3 * reference.abs().max()
    for name, grad in expected.items():
        assert (grads[name] - grad).abs().max() <= 1e-3 * grad.abs().max() + 1e-7, name
