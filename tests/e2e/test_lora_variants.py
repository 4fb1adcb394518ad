"""PEFT's LoRA variants as recipe fields (``lora.use_rslora``, ``use_dora``, ``loraplus_lr_ratio``,
``init_lora_weights``), each trained by ``sft`` on 4 CPU XLA devices; the adapter saved in ``final/``,
loaded by PEFT onto the original base, computes what the trained model computed (PiSSA's adapter is
converted for the original base, since training ran on the residual)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import train_tiny
from transformers import AutoModelForCausalLM

QUICK = ["train.max_steps=12", "train.logging_steps=4", "train.eval_steps=null", "train.eval_samples=0"]
VARIANTS = {  # rsLoRA (a scale) and LoRA+ (the optimizer's rates) change nothing else: one run holds both
    "rslora+loraplus": ["lora.use_rslora=true", "lora.loraplus_lr_ratio=16"],
    "dora": ["lora.use_dora=true"],
    "pissa": ["lora.init_lora_weights=pissa_niter_4"],
    "modules_to_save": ["lora.modules_to_save=[lm_head]"],  # the head trained whole, saved with the adapter
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    from tiny_models import make_base

    make_base(base)
    local = [f"model.name_or_path={base}", "model.random_init=false"]
    return {name: train_tiny(tmp_path_factory, name, *QUICK, *local, *extra) for name, extra in VARIANTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_trains_and_its_adapter_reproduces_the_trained_model(runs, name):
    from peft import PeftModel

    _, run = runs[name]
    losses = [e["loss"] for e in run.metrics["train"]["losses"]]
    assert losses[-1] < losses[0], losses
    assert run.metrics["compiles"]["after_warmup"] == 0
    config = json.loads((run.final_dir / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, run.final_dir).eval()
    ids = torch.tensor(run.trainer.eval_dataset[:4]["input_ids"])
    with torch.no_grad():
        trained = run.trainer.fsdp_model.eval()(input_ids=ids.to(run.trainer.runtime.device)).logits.cpu()
        saved = reloaded(input_ids=ids).logits
    assert torch.allclose(saved, trained, atol=2e-4, rtol=1e-4), (saved - trained).abs().max()
    if name == "pissa":  # converted as PEFT converts: rank and alpha doubled, a plain LoRA init
        assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (32, 64, True)
    if name == "modules_to_save":
        assert any("lm_head" in k and "lora_" not in k for k in run.trainer.names.adapter_keys)
    if name == "rslora+loraplus":
        assert config["use_rslora"]
    if name == "dora":
        assert config["use_dora"] and any("lora_magnitude_vector" in k for k in run.trainer.names.adapter_keys)


@pytest.mark.slow
def test_loraplus_gives_b_its_own_learning_rate(runs):
    _, run = runs["rslora+loraplus"]
    rates = sorted({group["initial_lr"] for group in run.trainer.optimizer.param_groups if group["params"]})
    assert len(rates) == 2 and rates[1] == pytest.approx(16 * rates[0])
