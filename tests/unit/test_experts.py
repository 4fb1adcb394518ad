"""Mixture-of-experts layers: ``static`` experts against transformers' own eager experts, and the Hub's
one-key-per-expert checkpoints read into the stacked parameters (``from_pretrained`` equality and a missing
expert refused, as for every family: test_families.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowmem_tpu.config import ModelSection
from lowmem_tpu.errors import UserError
from lowmem_tpu.model import build_base_model
from lowmem_tpu.model.experts import NAME


def _logits_and_grads(model, ids):
    model.zero_grad()
    for name, param in model.named_parameters():
        param.requires_grad_("experts" in name or "embed" in name or "router" in name)
    out = model(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4_moe", "gpt_oss"])  # Gemma 4: beside a dense MLP
def test_static_experts_equal_transformers_eager_experts(stand_ins, family):
    model = build_base_model(ModelSection(name_or_path=str(stand_ins[family]), dtype="float32"))
    assert model.config._experts_implementation == NAME
    ids = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(0))
    ours, our_grads = _logits_and_grads(model, ids)
    model.set_experts_implementation("eager")
    theirs, their_grads = _logits_and_grads(model, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5 * theirs.abs().max().item())
    assert our_grads.keys() == their_grads.keys() and any("gate_up_proj" in n for n in our_grads)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item() + 1e-12)


def test_the_stacked_layout_saved_by_the_project_reads_back_in_both(stand_ins, tmp_path):
    """A merged MoE model is saved by save_pretrained: transformers and the project read it back alike."""
    model = build_base_model(ModelSection(name_or_path=str(stand_ins["qwen3_moe"]), dtype="float32"))
    model.save_pretrained(tmp_path)
    again = build_base_model(ModelSection(name_or_path=str(tmp_path), dtype="float32"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
        assert torch.equal(theirs.state_dict()[name], tensor), name


def test_lora_adapts_the_experts_in_pefts_layout_and_trains_as_with_eager_experts(stand_ins):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.model import apply_lora

    recipe = load_recipe(None, [f"model.name_or_path={stand_ins['qwen3_moe']}", "model.dtype=float32"])
    model = apply_lora(build_base_model(recipe.model), recipe)
    assert set(model.peft_config["default"].target_parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    adapted = {n.split(".lora_")[0].split("layers.0.")[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert {"mlp.experts.base_layer", "mlp.experts"} <= adapted and "mlp.gate" not in adapted, adapted
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # B starts at zero: the experts' A would get no gradient
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad()
        model(input_ids=ids).logits.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = grads()
    model.base_model.model.set_experts_implementation("eager")
    theirs = grads()
    assert ours.keys() == theirs.keys() and sum("experts" in n for n in ours) == 2 * 2 * 2  # 2 layers, 2 stacks
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item() + 1e-12)


@pytest.mark.parametrize("lora", [False, True])
def test_the_planner_counts_every_expert_and_moe_flops_count_the_active_ones(stand_ins, lora):
    """The planner's parameters equal the meta model's (adapters included), for the stand-ins, gpt-oss-20b and
    Qwen3-30B-A3B (30.5 B, 3.3 B of them active per token); the MFU's FLOPs count the active experts only."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.memory.plan import parameters
    from lowmem_tpu.memory.shape import setting_of, shape_of
    from lowmem_tpu.model import apply_lora, count_parameters, flops_per_token
    from lowmem_tpu.model.build import load_config, meta_model, require_config

    # gpt-oss's expert and router biases and attention sinks counted too
    for name in (str(stand_ins["gpt_oss"]), "openai/gpt-oss-20b", str(stand_ins["qwen3_moe"]), "Qwen/Qwen3-30B-A3B"):
        recipe = load_recipe(None, [f"model.name_or_path={name}", f"lora.enabled={str(lora).lower()}"])
        config = require_config(recipe)
        model = apply_lora(meta_model(load_config(recipe.model, offline=True), recipe.model), recipe, weightless=True)
        trainable, total = count_parameters(model)
        planned = parameters(shape_of(config), setting_of(recipe, 1))
        assert sum(t.parameters for t in planned) == total
        assert sum(t.parameters for t in planned if t.trainable) == trainable
    assert total - (trainable if lora else 0) == 30_532_122_624
    from lowmem_tpu.memory.advise import format_plan, plan_recipe

    idle = 48 * (128 - 8) * 3 * 768 * 2048  # the experts a token does not go through, every layer
    shown = format_plan("plan", plan_recipe(recipe, "v5e-8", config).plan, [])[0]
    assert f"a token goes through {30_532_122_624 - idle:,} of the base's" in shown
    per_token = flops_per_token(config, total, trainable, 1, lora)
    assert 4 * 3.0e9 < per_token < 6 * 3.6e9  # about 3 B active weights: 4 or 6 FLOPs each, not 30 B


def test_quantizing_a_moe_base_is_refused_rather_than_leaving_its_experts_in_bf16(stand_ins):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.architecture import check_model
    from lowmem_tpu.model.build import require_config

    recipe = load_recipe(None, [f"model.name_or_path={stand_ins['qwen3_moe']}", "model.quantize=nf4"])
    for refuse in (lambda: check_model(recipe), lambda: plan_recipe(recipe, "v5e-8", require_config(recipe))):
        with pytest.raises(UserError, match=r"model.quantize: nf4 .* 8 stacked experts per layer.*quantize: none"):
            refuse()
    from lowmem_tpu.model import quantize_base

    for weights in ("checkpoint", "random"):  # quantized as read, or after a random init
        with pytest.raises(UserError, match=r"stacked experts"):
            quantize_base(build_base_model(recipe.model, weights=weights), recipe.model)


def test_packed_rows_with_eager_attention_are_refused_for_the_load_balancing_loss(stand_ins):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.model.architecture import check_model

    base = [f"model.name_or_path={stand_ins['qwen3_moe']}", "data.packing=true"]
    with pytest.raises(UserError, match=r"load-balancing loss reads the mask as \[batch, length\].*chunked"):
        check_model(load_recipe(None, [*base, "model.attn_implementation=eager"]))
    check_model(load_recipe(None, [*base, "model.attn_implementation=chunked"]))


def test_gpt_oss_sinks_refuse_flash_and_sdpa_and_other_quantized_checkpoints_are_named(stand_ins, tmp_path):
    """Chunked computes the attention sinks (e2e/test_family_attention.py); flash and sdpa have none. The Hub's
    MXFP4 experts are read (unit/test_families.py: from_pretrained equality); another quantized format is
    refused by name rather than reported as missing weights."""
    import json
    import shutil

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.model.architecture import check_model
    from lowmem_tpu.model.build import load_config

    name = f"model.name_or_path={stand_ins['gpt_oss']}"
    with pytest.raises(UserError, match=r"sdpa has no attention sinks, which gpt_oss defines; use chunked"):
        check_model(load_recipe(None, [name, "model.attn_implementation=sdpa"]))
    with pytest.raises(UserError, match=r"flash .* has no .*attention sinks, which gpt_oss defines"):
        check_model(load_recipe(None, [name, "model.attn_implementation=flash", "data.max_length=128"]))
    check_model(load_recipe(None, [name, "model.attn_implementation=chunked"]))
    gptq = tmp_path / "gptq"
    shutil.copytree(stand_ins["gpt_oss"], gptq)
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UserError, match=r"stored quantized \(gptq\).*model.quantize"):
        load_config(ModelSection(name_or_path=str(gptq)))
    # the shipped config too (random_init, planning): a model built from it saves unquantized
    assert not hasattr(
        load_config(ModelSection(name_or_path="openai/gpt-oss-20b"), offline=True), "quantization_config"
    )
