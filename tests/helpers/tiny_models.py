"""Tiny Llama bases and LoRA adapters on disk, shaped like what ``sft`` writes, and short real ``sft`` runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.assets import ASSETS

TINY = ASSETS / "tiny-llama"


def make_base(path: Path, seed: int = 0, **config_overrides) -> Path:
    """A random-init tiny Llama (the shipped config) with the shipped tokenizer, saved like output_dir/base."""
    config = AutoConfig.from_pretrained(TINY, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(path)
    return path


def make_adapter(base: Path, path: Path, seed: int = 1, r: int = 4, overrides: tuple[str, ...] = ()) -> Path:
    """A LoRA adapter (random A and B, so merging changes every targeted weight) for ``base``.

    Like ``output_dir/final``: adapter files, tokenizer, resolved recipe.yaml and metrics.json.
    """
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B is small but not zero, as after training
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
    peft_model.save_pretrained(path)
    (path / "README.md").unlink()  # PEFT writes a template card; sft does not
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    recipe = load_recipe(None, [f"model.name_or_path={base}", "model.random_init=false", f"lora.r={r}", *overrides])
    (path / "recipe.yaml").write_text(recipe.to_yaml())
    (path / "metrics.json").write_text(json.dumps(METRICS, indent=2))
    return path


METRICS = {  # the keys sft's _metrics writes, with plausible values
    "platform": "CPU",
    "num_devices": 4,
    "mode": "lora",
    "trainable_parameters": 139264,
    "total_parameters": 808064,
    "steps": 300,
    "global_batch_size": 64,
    "micro_batch_size": 64,
    "max_length": 24,
    "data": {"samples": 4000, "rows": 4000, "truncated": 0, "dropped": 0, "trained_tokens": 24000},
    "train": {"final_loss": 1.5123, "mean_loss": 2.2567, "steady_tokens_per_second": 3544.5},
    "eval": {
        "before": {"loss": 3.9352, "token_accuracy": 0.0312, "exact_match": 0.0, "exact_match_total": 200},
        "after": {"loss": 1.5131, "token_accuracy": 1.0, "exact_match": 1.0, "exact_match_total": 200},
    },
}


def moved_model(base: Path, out: Path) -> Path:
    """A full model a step of training could have made from ``base``: every weight LoRA targets changed."""
    from peft import PeftModel

    adapter = make_adapter(base, out.with_name(out.name + "-adapter"), r=4, seed=3)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
    merged.save_pretrained(out)
    return out


def train_tiny(tmp_path_factory, name: str, *overrides: str):
    """``sft`` on the embedded recipe in a fresh temporary output_dir: (recipe, result)."""
    from lowmem_tpu.run import run_training

    recipe = load_recipe("recipes/tiny_lora_cpu.yaml", [f"output_dir={tmp_path_factory.mktemp(name)}", *overrides])
    return recipe, run_training(recipe)
