"""End-to-end SFT on 4 CPU XLA devices: real torch_xla, transformers, peft, trl, datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import train_tiny

from lowmem_tpu.config import load_recipe

pytestmark = pytest.mark.slow

SHORT = [
    "train.max_steps=12",
    "train.logging_steps=3",
    "train.eval_steps=6",
    "train.eval_samples=8",
    "train.global_batch_size=16",
    "train.warmup_steps=2",
]


def _run(tmp_path_factory, name: str, *overrides: str):
    return train_tiny(tmp_path_factory, name, *SHORT, *overrides)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    return _run(tmp_path_factory, "lora")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, lora_run):
    # Full fine-tuning of a pretrained model from a local directory (the LoRA run's saved base),
    # with gradient accumulation, Adafactor and the fused LM head.
    base = Path(lora_run[0].output_dir) / "base"
    return _run(
        tmp_path_factory,
        "full",
        f"model.name_or_path={base}",
        "model.random_init=false",
        "lora.enabled=false",
        "train.optimizer=adafactor",
        "train.gradient_accumulation_steps=2",
        "train.learning_rate=1e-3",
        "train.fused_lm_head=true",  # TRL's chunked LM head: the model output has logits=None (trap logits-none)
    )


def _initial_model(recipe):
    from lowmem_tpu import model as modeling

    model = modeling.build_base_model(recipe.model, recipe.train.seed)
    return modeling.apply_lora(model, recipe)


def test_lora_output_files(lora_run):
    recipe, run = lora_run
    files = {p.name for p in run.final_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "recipe.yaml", "metrics.json"} <= files
    assert "tokenizer.json" in files
    assert not (run.final_dir.parent / "final.partial").exists()
    assert load_recipe(run.final_dir / "recipe.yaml") == recipe.model_copy(update={"extends": None})
    metrics = json.loads((run.final_dir / "metrics.json").read_text())
    assert metrics["mode"] == "lora" and metrics["num_devices"] == 4
    assert [e["step"] for e in metrics["train"]["losses"]] == [3, 6, 9, 12]
    assert metrics["train"]["steady_tokens_per_second"] > 0


def test_no_device_loader_thread_outlives_the_run(lora_run):
    # 12 steps of 16 sequences stop mid-epoch: torch_xla's prefetch threads would stay blocked, batches held.
    import threading

    feeding = [t.name for t in threading.enumerate() if t.name.endswith(("(_loader_worker)", "(_worker)"))]
    assert not feeding, feeding


def test_parameters_are_really_sharded(lora_run):
    from lowmem_tpu.xla.device import sharding_spec

    _, run = lora_run
    specs = {name: sharding_spec(p) for name, p in run.names.params.items()}
    for name, spec in specs.items():
        assert spec.startswith("{devices=[") and "replicated" not in spec, (name, spec)
    # A 128x128 projection is split along dim 0, a 16x128 LoRA A along its larger dim 1.
    assert specs["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].startswith("{devices=[4,1]")
    assert specs["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].startswith("{devices=[1,4]")


def test_lora_trains_adapters_and_keeps_base_bit_identical(lora_run):
    from safetensors.torch import load_file

    recipe, run = lora_run
    trained = run.names.host_state()
    initial = dict(_initial_model(recipe).named_parameters())
    saved_base = load_file(str(Path(recipe.output_dir) / "base" / "model.safetensors"))
    lora = [n for n in trained if "lora_" in n]
    assert len(lora) == 4 * 7 * 2
    for name in lora:
        assert not torch.equal(trained[name], initial[name].detach()), f"{name} did not train"
    for name, value in trained.items():
        if "lora_" in name:
            continue
        assert torch.equal(value, initial[name].detach()), f"base weight {name} changed"
        base_key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(value, saved_base[base_key]), f"saved base differs at {base_key}"


def test_saved_adapter_reloads_with_plain_peft(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run = lora_run
    config = json.loads((run.final_dir / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, run.final_dir).eval()

    ids = torch.tensor(run.trainer.eval_dataset[:8]["input_ids"])
    model = run.trainer.fsdp_model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids.to(run.trainer.runtime.device)).logits.cpu()
        expected = reloaded(input_ids=ids).logits
    assert torch.allclose(trained, expected, atol=1e-4), (trained - expected).abs().max()


def test_no_compilation_after_warmup(lora_run):
    _, run = lora_run
    compiles = run.metrics["compiles"]
    # Warm-up ends one step after the first log (step 3) and the first evaluation (step 6).
    assert compiles["warmup_steps"] == 7
    assert compiles["during_warmup"] > 0
    assert compiles["after_warmup"] == 0


def test_full_finetuning_changes_every_parameter_and_saves_a_loadable_model(full_run):
    from transformers import AutoModelForCausalLM

    recipe, run = full_run
    files = {p.name for p in run.final_dir.iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "adapter_config.json" not in files
    initial = dict(_initial_model(recipe).named_parameters())
    loaded = AutoModelForCausalLM.from_pretrained(run.final_dir, dtype=torch.float32)
    saved = dict(loaded.named_parameters())
    assert saved.keys() == initial.keys()
    for name, value in saved.items():
        assert not torch.equal(value, initial[name].detach()), f"{name} did not train"
    assert run.metrics["trainable_parameters"] == run.metrics["total_parameters"]
    assert run.metrics["micro_batch_size"] == 8  # 16 samples in 2 accumulation steps
    assert run.metrics["compiles"]["after_warmup"] == 0


def test_nonfinite_weights_never_reach_a_checkpoint(lora_run):
    from lowmem_tpu.errors import NonFiniteError

    recipe, run = lora_run
    name = next(n for n in run.names.params if "lora_B" in n)
    param = run.names.params[name]
    kept = param.detach().cpu().clone()
    with torch.no_grad():
        param.fill_(float("nan"))
    try:
        with pytest.raises(NonFiniteError, match=f"step {run.trainer.state.global_step}: non-finite"):
            run.trainer._save_checkpoint(run.trainer.fsdp_model, None)
    finally:
        with torch.no_grad():
            param.copy_(kept.to(param.device))
    checkpoints = Path(recipe.output_dir) / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_guard_stops_on_nonfinite_loss_and_warns_on_spikes(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lowmem_tpu.errors import NonFiniteError
    from lowmem_tpu.train.guard import GuardCallback

    warnings: list[str] = []
    guard = GuardCallback(None, 5.0, warnings.append)
    args, control, state = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerControl(), TrainerState()
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 30.0], start=1):
        state.global_step = step
        guard.on_log(args, state, control, logs={"loss": loss, "grad_norm": 1.0})
    assert warnings == ["warning: loss spike at step 5: 30.0000 vs running mean 2.0000"]
    state.global_step = 6
    with pytest.raises(NonFiniteError, match="step 6: grad_norm is inf"):
        guard.on_log(args, state, control, logs={"loss": 2.0, "grad_norm": float("inf")})


def test_scan_layers_trains_exactly_like_unrolled_layers(tmp_path_factory):
    """sharding.scan_layers: one compiled layer scanned over all (LoRA, FSDP, checkpointing kept)."""
    pytest.importorskip("torchax", reason="the [scan] extra is not installed")
    quick = ["train.max_steps=4", "train.logging_steps=1", "train.eval_samples=0", "train.eval_steps=null"]
    quick += ["data.eval_path=null"]
    _, unrolled = _run(tmp_path_factory, "unrolled", *quick)
    _, scanned = _run(tmp_path_factory, "scanned", *quick, "sharding.scan_layers=true")
    a, b = (r.metrics["train"]["losses"] for r in (unrolled, scanned))
    assert [e["step"] for e in a] == [e["step"] for e in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)
    assert (scanned.final_dir / "adapter_model.safetensors").exists()


ONE_STEP = ["train.max_steps=1", "train.logging_steps=1", "train.eval_samples=0", "train.eval_steps=null"]
ONE_STEP += ["data.eval_path=null", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    return _run(tmp_path_factory, "one-step", *ONE_STEP)[1]


def _same_step(a, b, adapter_tolerance: float = 1e-4) -> None:
    """Two one-step runs logged the same loss and gradient norm and saved (nearly) the same adapter."""
    from safetensors.torch import load_file

    logs = [[e for e in r.metrics["train"]["log"] if "loss" in e] for r in (a, b)]
    assert len(logs[0]) == len(logs[1]) == 1
    for x, y in zip(*logs, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
    x, y = (load_file(r.final_dir / "adapter_model.safetensors") for r in (a, b))
    # AdamW turns gradients equal to ~1e-7 into updates equal to ~1e-5 (lr 3e-3): far below a step
    assert max((x[k] - y[k]).abs().max().item() for k in x) < adapter_tolerance


def test_accumulation_gives_the_unaccumulated_step(tmp_path_factory, one_step):
    """train.gradient_accumulation_steps: one micro-batch per XLA program, the same step as without."""
    _, two = _run(tmp_path_factory, "acc2", *ONE_STEP, "train.gradient_accumulation_steps=2")
    _same_step(one_step, two)
    assert two.metrics["micro_batch_size"] == 8


def test_checkpointing_one_layer_in_two_gives_the_same_step(tmp_path_factory, one_step):
    """sharding.activation_checkpointing: every_2 recomputes layer 0 only (of 2): the same arithmetic."""
    _, every2 = _run(tmp_path_factory, "every2", *ONE_STEP, "sharding.activation_checkpointing=every_2")
    _same_step(one_step, every2)


def test_the_weights_replicated_on_every_device_give_the_same_step(tmp_path_factory, one_step):
    """sharding.strategy: replicated (where tune may place a frozen base): no gathers, the same arithmetic."""
    _, replicated = _run(tmp_path_factory, "replicated", *ONE_STEP, "sharding.strategy=replicated")
    _same_step(one_step, replicated)


def test_chunked_loss_gives_the_same_step(tmp_path_factory, one_step):
    """train.chunked_loss through the real trainer: 8 blocks of the tiny recipe's positions, same step."""
    _, chunked = _run(tmp_path_factory, "chunked-loss", *ONE_STEP, "train.chunked_loss=true")
    _same_step(one_step, chunked)
    log = next(e for e in chunked.metrics["train"]["log"] if "loss" in e)
    assert 0 <= log["token_accuracy"] <= 1  # counted from the blocks' top-1 hits


def test_skip_mode_drops_a_nonfinite_update_exactly(lora_run, tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lowmem_tpu.train.guard import GuardCallback

    _, run = lora_run
    optimizer = run.trainer.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().cpu().clone() for p in params]
    for i, param in enumerate(params):
        param.grad = torch.full_like(param, float("nan") if i == 0 else 1.0)
    warnings: list[str] = []
    guard = GuardCallback(None, 0.0, warnings.append, skip_nonfinite=True)
    state = TrainerState()
    state.global_step = 41
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    guard.on_pre_optimizer_step(args, state, TrainerControl(), optimizer=optimizer)
    assert all(p.grad is None for p in params)
    getattr(optimizer, "optimizer", optimizer).step()  # the torch optimizer inside accelerate's wrapper
    assert all(torch.equal(p.detach().cpu(), b) for p, b in zip(params, before, strict=True))
    assert guard.skipped_steps == [42] and "step 42: non-finite gradients, update skipped" in warnings[0]
    guard.on_log(args, state, TrainerControl(), logs={"loss": float("nan")})  # skip mode: no stop


@pytest.mark.parametrize("impl", ["chunked"])  # eager/sdpa's block mask: test_levers, on the model itself
def test_packed_rows_train_through_the_real_trainer(tmp_path_factory, impl):
    """data.packing: segment ids and restarting positions reach the model on the XLA devices."""
    quick = [*ONE_STEP, "train.max_steps=2", "data.packing=true", "data.max_length=72"]
    quick += [f"model.attn_implementation={impl}"]  # samples of 22 tokens (BOS leads): 3 per row
    _, run = _run(tmp_path_factory, f"packed-{impl}", *quick)
    losses = [e["loss"] for e in run.metrics["train"]["log"] if "loss" in e]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert run.metrics["data"]["rows"] == -(-run.metrics["data"]["samples"] // 3)
