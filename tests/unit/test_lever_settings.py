"""Memory levers' settings: the flash kernel's name, and the combinations the recipe refuses (the levers'
arithmetic, chunked attention and the chunked loss against what they replace: e2e/test_levers.py)."""

from __future__ import annotations

import pytest
import torch
from attention_models import tiny_llama as _tiny

from lowmem_tpu.config import load_recipe
from lowmem_tpu.model import attention


def test_flash_builds_under_a_name_transformers_does_not_take_for_cuda_flash_attn():
    """transformers 5 reads any attn_implementation with "flash" in it as the CUDA package or a Hub kernel."""
    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import meta_model
    from lowmem_tpu.model.build import load_config

    cfg = ModelSection(name_or_path="builtin:tiny-llama", random_init=True, attn_implementation="flash")
    model = meta_model(load_config(cfg, offline=True), cfg)
    assert model.config._attn_implementation == attention.FLASH_NAME and "flash" not in attention.FLASH_NAME
    with pytest.raises(RuntimeError, match="runs on a TPU only"):  # our kernel is reached (none off a TPU)
        _tiny("flash")(torch.zeros(1, 4, dtype=torch.long))


def test_a_cpu_rehearsal_runs_chunked_for_flash_and_says_so():
    """flash is a TPU kernel: on the CPU backend the run computes the same attention with chunked."""
    from lowmem_tpu.preflight import as_run_here

    flash = load_recipe("recipes/open_llama_lora.yaml", ["runtime.device=cpu"])
    assert flash.model.attn_implementation == "flash"
    here, notes = as_run_here(flash)
    assert here.model.attn_implementation == "chunked" and here.lora == flash.lora and here.data == flash.data
    assert notes == [notes[0]] and "model.attn_implementation=chunked" in notes[0] and "Pallas TPU kernel" in notes[0]
    on_tpu = load_recipe("recipes/open_llama_lora.yaml", ["runtime.device=tpu"])
    assert as_run_here(on_tpu) == (on_tpu, [])


def test_chunked_loss_refuses_the_fused_head_too():
    from lowmem_tpu.config import RecipeError

    with pytest.raises(RecipeError, match="two ways to skip the logits"):
        load_recipe("recipes/tiny_lora_cpu.yaml", ["train.chunked_loss=true", "train.fused_lm_head=true"])


# ----------------------------------------------------------------------------- checkpointing policies, offload


def test_checkpointing_policies_are_parsed_and_bad_ones_refused():
    from lowmem_tpu.config import RecipeError

    every = {
        v: load_recipe("recipes/tiny_lora_cpu.yaml", [f"sharding.activation_checkpointing={v}"])
        for v in ("true", "false", "every_2", "every_3")
    }
    assert [r.sharding.checkpoint_every for r in every.values()] == [1, 0, 2, 3]
    for bad in ("every_1", "every", "sometimes"):
        with pytest.raises(RecipeError, match="every_K with K >= 2"):
            load_recipe("recipes/tiny_lora_cpu.yaml", [f"sharding.activation_checkpointing={bad}"])
    with pytest.raises(RecipeError, match="scan_layers runs one compiled layer"):
        load_recipe(
            "recipes/tiny_lora_cpu.yaml", ["sharding.activation_checkpointing=every_2", "sharding.scan_layers=true"]
        )
