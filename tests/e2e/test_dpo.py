"""``lowmem-tpu dpo`` against TRL itself: on the same tiny model, pairs and LoRA weights, the loss and rewards
the XLA step computes (4 virtual devices, FSDP, the rows at their static shape) equal TRL's DPOTrainer on plain
CPU PyTorch (its own tokenization and padding) within 1e-4, and so do the adapters' gradients; a run from fresh
adapters starts at ln 2 with every reward 0, compiles nothing after warm-up, and writes an adapter that is
merged and carded as any run's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_adapter, make_base

from lowmem_tpu.config.assets import ASSETS
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.config.schema import DPO_LOSSES

PAIRS = ASSETS / "reverse" / "prefer_train.jsonl"
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
COMPARED = ("loss", *METHODS["dpo"].metrics)


def _trl_on_the_cpu(
    base: Path, adapter: Path, pairs: int, beta: float, losses: str, out: Path, start: Path | None = None,
    options: dict | None = None,
) -> dict:  # fmt: skip
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(HELPERS / "dpo_reference.py"), str(base), str(adapter), str(PAIRS)]
    command += [str(pairs), str(beta), losses, str(out), str(start or ""), json.dumps(options or {})]
    subprocess.run(command, env=env, check=True, timeout=300)
    return json.loads(out.read_text())


def _xla_step(
    base: Path, adapter: Path, pairs: int, beta: float, losses: str, out: Path, start: Path | None = None,
    options: dict | None = None, method: str = "dpo", picks: list[int] | None = None,
) -> dict:  # fmt: skip
    """One XlaPreferenceTrainer loss on the devices, the policy ``adapter`` on ``base``; the reference the base, or
    with ``start`` the frozen copy of that adapter TRL makes (the policy then moved to ``adapter``'s weights).
    ``adapter`` a model directory: full-parameter DPO, the reference's log-probs precomputed by ``base``
    (the model before training), the policy then moved to that model's weights."""
    import torch

    from lowmem_tpu import data
    from lowmem_tpu import model as m
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.data.pairs import collate_pairs
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.train.args import preference_args
    from lowmem_tpu.train.preference import XlaPreferenceTrainer
    from lowmem_tpu.xla.runtime import configure_environment, setup_runtime, sync
    from lowmem_tpu.xla.sharding import place_parameters

    full = not (adapter / "adapter_config.json").is_file()
    overrides = [f"model.name_or_path={base}", "model.random_init=false"]
    overrides += ["lora.enabled=false"] if full else [f"model.adapter={start or adapter}"]
    overrides += [f"output_dir={out}", f"train.global_batch_size={pairs}", f"preference.beta={beta}"]
    overrides += [f"preference.{key}={json.dumps(value)}" for key, value in (options or {}).items()]
    overrides += ["train.eval_steps=null", "data.eval_path=null", "train.eval_samples=0", f"method={method}"]
    recipe = load_recipe("recipes/tiny_dpo_cpu.yaml", [*overrides, f"preference.loss_type=[{losses}]"])
    configure_environment(recipe.runtime)
    runtime = setup_runtime(recipe.runtime)
    tokenizer = m.load_tokenizer(recipe.model)
    data.set_chat_template(tokenizer, recipe.data)
    kto = method == "kto"
    rows, _ = data.build_dataset(recipe.data, tokenizer, max_samples=pairs, unpaired=kto)
    policy = m.apply_lora(m.build_base_model(recipe.model), recipe)
    place_parameters(policy, runtime, recipe.sharding.strategy)
    trainer = XlaPreferenceTrainer(
        fresh_adapters=start is None,  # the reference: the base, as TRL's with a fresh PEFT model
        recipe=recipe, runtime=runtime, names=ParamNames(policy), model=policy,
        args=preference_args(recipe, pairs), train_dataset=rows, processing_class=tokenizer,
    )  # fmt: skip
    from safetensors.torch import load_file

    if full:  # the reference as TRL computes it at the start, then the policy moves (a trained step's weights)
        rows = trainer._with_reference(rows.select(range(pairs)), "train")
        assert trainer.precompute_ref_logps
        for key, value in load_file(str(adapter / "model.safetensors")).items():
            trainer.names.params[key].data.copy_(value.to(runtime.device))
    elif start:  # the policy moved away from the adapter it started from (and TRL's frozen copy of it)
        for key, value in load_file(str(adapter / "adapter_model.safetensors")).items():
            trainer.names.params[trainer.names.adapter_keys[key]].data.copy_(value.to(runtime.device))
    from lowmem_tpu.data.unpaired import collate_unpaired

    picked = [rows[i] for i in picks or range(pairs)]  # KTO: ``pairs`` records are twice as many rows
    batch = collate_unpaired(picked) if kto else collate_pairs(picked)
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({key: value for key, value in batch.items()}, out / "rows.safetensors")
    batch = {key: value.to(runtime.device) for key, value in batch.items()}
    wrapped = trainer.fsdp_model
    wrapped.train()
    loss = trainer.compute_loss(wrapped, batch)
    assert isinstance(loss, torch.Tensor) and loss.device.type == "xla"
    loss.backward()
    sync()  # one program for every gradient: .cpu() on each pending one would compile a program each
    grads = {name: p.grad.cpu() for name, p in trainer.names.params.items() if p.requires_grad}  # clean names
    return {"loss": loss.item(), **trainer.device_metrics.means("train"), "grads": grads}


@pytest.mark.parametrize(
    ("losses", "options"),
    [
        ("sigmoid", {}),
        ("sigmoid,sft", {"loss_weights": [1.0, 0.3], "f_divergence_type": "js_divergence"}),  # weighted RPO, JS
        (",".join(DPO_LOSSES), {"label_smoothing": 0.1}),  # every loss, summed: exo_pair's tensors on the host
        (
            "sigmoid",
            {
                "f_divergence_type": "alpha_divergence",
                "f_alpha_divergence_coef": 0.3,
                "use_weighting": True,
                "ld_alpha": 0.5,
            },
        ),  # alpha, WPO, LD-DPO
    ],
    ids=["sigmoid", "rpo-weighted-js", "every-loss", "alpha-wpo-ld"],
)
def test_the_xla_step_computes_trls_loss_and_rewards(tmp_path, losses, options):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", r=4)  # B not zero: the policy is not the reference
    trl = _trl_on_the_cpu(base, adapter, 8, 0.5, losses, tmp_path / "trl.json", options=options)
    ours = _xla_step(base, adapter, 8, 0.5, losses.replace(",", ", "), tmp_path / "run", options=options)
    assert abs(trl["rewards/margins"]) > 1e-3  # a batch where policy and reference differ
    for key in COMPARED:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4), key
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():  # every adapter's gradient, as TRL computes it
        assert torch.allclose(ours["grads"][name], grad, atol=1e-5, rtol=1e-3), name


@pytest.mark.parametrize(
    ("method", "loss", "options"),
    [
        ("orpo", "sigmoid", {}),
        ("cpo", "hinge", {"label_smoothing": 0.0}),
        ("cpo", "sigmoid", {"label_smoothing": 0.1, "alphapo_alpha": 0.2}),  # AlphaPO's rewards
        ("simpo", "sigmoid", {"simpo_gamma": 0.3}),
    ],
    ids=["orpo", "cpo-hinge", "cpo-alphapo", "simpo"],
)
def test_the_reference_free_methods_compute_trls_loss_metrics_and_gradients(tmp_path, method, loss, options):
    """ORPO, CPO and SimPO on the devices (one policy pass, no reference) against TRL's ORPOTrainer and
    CPOTrainer on plain CPU PyTorch, fed the same rows: loss, every figure TRL logs, every adapter's gradient."""
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", r=4)
    ours = _xla_step(base, adapter, 8, 0.5, loss, tmp_path / "run", options=options, method=method)
    trl_options = {"beta": 0.5, **{k.removeprefix("alphapo_"): v for k, v in options.items()}}
    if method == "cpo":
        trl_options["loss_type"] = loss
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(HELPERS / "pair_reference.py"), method, str(base), str(adapter)]
    command += [str(tmp_path / "run" / "rows.safetensors"), json.dumps(trl_options), str(tmp_path / "trl.json")]
    subprocess.run(command, env=env, check=True, timeout=300)
    trl = json.loads((tmp_path / "trl.json").read_text())
    assert sorted(trl) == sorted(("loss", *METHODS[method].metrics))  # the table lists what TRL logs
    for key in trl:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4, rel=1e-4), key
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():
        # AlphaPO's rewards (exp(-alpha x log p) of summed log-probs) put fp32's rounding at ~2e-5 of gradients ~1.5
        atol = 3e-5 if options.get("alphapo_alpha") else 1e-5
        assert torch.allclose(ours["grads"][name], grad, atol=atol, rtol=1e-3), name


@pytest.mark.parametrize(
    ("picks", "options"),
    [
        ([0, 1, 2, 8, 9, 10, 11, 12], {"desirable_weight": 1.5}),  # 3 desirable, 5 undesirable rows
        (list(range(8)), {}),  # every row desirable
        (list(range(8, 16)), {"undesirable_weight": 0.7}),  # every row undesirable
        ([0, 1, 2, 3, 8, 9, 10, 11], {"kto_loss": "apo_zero_unpaired"}),  # no KL term
    ],
    ids=["mixed", "all-desirable", "all-undesirable", "apo-zero-unpaired"],
)
def test_kto_computes_trls_loss_metrics_and_gradients(tmp_path, picks, options):
    """KTO on the devices (policy and reference on the rows and the KL rows, one program) against TRL's
    KTOTrainer on plain CPU PyTorch, fed the same rows: loss, every figure TRL logs (those it logs for the batch),
    every adapter's gradient. 8 pairs read as KTO: rows 0-7 desirable (the chosen), 8-15 undesirable."""
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", r=4)
    ours = _xla_step(base, adapter, 8, 0.5, "sigmoid", tmp_path / "run", options=options, method="kto", picks=picks)
    trl_options = {"beta": 0.5, **{("loss_type" if k == "kto_loss" else k): v for k, v in options.items()}}
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(HELPERS / "kto_reference.py"), str(base), str(adapter)]
    command += [str(tmp_path / "run" / "rows.safetensors"), json.dumps(trl_options), str(tmp_path / "trl.json")]
    subprocess.run(command, env=env, check=True, timeout=300)
    trl = json.loads((tmp_path / "trl.json").read_text())
    logged = {key for key in ours if key in METHODS["kto"].metrics or key == "loss"}
    assert logged == set(trl)  # what a batch without desirable (or undesirable) rows leaves out, left out alike
    for key in trl:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4, rel=1e-4), key
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():
        assert torch.allclose(ours["grads"][name], grad, atol=1e-5, rtol=1e-3), name


@pytest.mark.slow
def test_a_full_parameter_dpo_run_starts_at_its_reference_and_eval_rebuilds_it(tmp_path):
    """``dpo`` with lora.enabled=false: the reference precomputed before step 1 (ln 2, every margin 0), nothing
    compiled after warm-up, the card says so, and ``eval`` on the saved model reloads the starting model as its
    reference and gives the run's own after-training figures."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "lora.enabled=false", "train.max_steps=6", "train.logging_steps=2"]
    overrides += ["train.eval_steps=3", "train.eval_samples=8", "train.global_batch_size=16"]
    overrides += ["data.max_samples=256"]  # eval: every held-out pair, as eval scores them
    overrides += ["preference.loss_type=sigmoid"]
    done = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", "dpo", "recipes/tiny_dpo_cpu.yaml", *overrides],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference log-probabilities: 256 train pairs in" in done.stdout
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["reward_margin"] == 0 and before["preference_accuracy"] == 0  # bit for bit its reference
    assert abs(after["reward_margin"]) > 1e-4 and metrics["compiles"]["after_warmup"] == 0
    assert (out / "final" / "model.safetensors").is_file() and not (out / "final" / "adapter_config.json").exists()
    from lowmem_tpu.publish.card import model_card

    card = model_card(out / "final", "me/tiny-dpo", "model")
    assert "| reference | the starting model, its log-probabilities computed once, before the first step |" in card
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(out / "final"), "--data", held_out]
    scored = subprocess.run([*evaluate, "--samples", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    result = json.loads(scored.stdout)
    assert result["loss"] == pytest.approx(after["loss"], abs=1e-5)
    assert result["reward_margin"] == pytest.approx(after["reward_margin"], abs=1e-5)
    assert result["preference_accuracy"] == pytest.approx(after["preference_accuracy"], abs=1e-6)


def _moved(base: Path, out: Path) -> Path:
    """A full model a step of training could have made from ``base``: every targeted weight changed."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(base, out.with_name(out.name + "-adapter"), r=4, seed=3)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
    merged.save_pretrained(out)
    return out


def test_full_parameter_dpo_reads_the_precomputed_reference_as_trl_does(tmp_path):
    """Full-parameter DPO: TRL's ``precompute_ref_log_probs`` (the reference computed by the model before
    training), then the policy moved; loss, rewards and every weight's gradient equal TRL's on the CPU."""
    base = make_base(tmp_path / "base")
    moved = _moved(base, tmp_path / "moved")
    trl = _trl_on_the_cpu(base, moved, 8, 0.5, "sigmoid", tmp_path / "trl.json")
    ours = _xla_step(base, moved, 8, 0.5, "sigmoid", tmp_path / "run")
    assert abs(trl["rewards/margins"]) > 1e-3  # the policy is not its reference
    for key in COMPARED:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4), key
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and "model.embed_tokens.weight" in expected
    for name, grad in expected.items():
        assert torch.allclose(ours["grads"][name], grad, atol=1e-5, rtol=1e-3), name


@pytest.mark.slow
def test_a_dpo_run_starts_at_ln_2_and_compiles_nothing_after_warm_up(tmp_path):
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "train.max_steps=6", "train.logging_steps=2", "train.eval_steps=3"]
    overrides += ["train.eval_samples=8", "train.global_batch_size=16", "data.max_samples=256"]
    overrides += ["preference.loss_type=sigmoid"]  # DPO's loss alone: ln 2 at the start
    done = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", "dpo", "recipes/tiny_dpo_cpu.yaml", *overrides],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    before = metrics["eval"]["before"]
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference: fresh adapters
    assert before["reward_margin"] == 0 and before["preference_accuracy"] == 0  # TRL counts a tie as wrong
    assert metrics["compiles"]["after_warmup"] == 0, metrics["compiles"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in line and "tokens_per_second" in line for line in logged)
    assert any("eval_rewards/accuracies" in line for line in logged)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert "pref acc" in done.stdout and "margin" in done.stdout
    # Published as any run (merged as any adapter): the card says DPO
    from lowmem_tpu.publish.card import model_card

    card = model_card(out / "final", "me/tiny-dpo", "adapter")
    assert "- dpo" in card and "preference tuning: DPO, beta 0.1, loss sigmoid (TRL DPOTrainer's loss, " in card
    assert "| preference accuracy | 0.0000 |" in card and "lowmem-tpu dpo recipe.yaml" in card
    # eval scores the saved adapter as the run scored its held-out pairs after training
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(out / "final"), "--data", held_out]
    scored = subprocess.run([*evaluate, "--samples", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    after, result = metrics["eval"]["after"], json.loads(scored.stdout)
    assert result["loss"] == pytest.approx(after["loss"], abs=1e-4)
    assert result["preference_accuracy"] == pytest.approx(after["preference_accuracy"], abs=1e-6)
    assert result["exact_match"] == after["exact_match"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_orpo_and_kto_runs_log_trls_figures_and_compile_nothing_after_warm_up(tmp_path, method):
    """``lowmem-tpu orpo`` and ``kto`` on the tiny demo: TRL's figures in metrics.jsonl, nothing compiled after
    warm-up; KTO's KL estimate 0 at the first step (fresh adapters: the policy is its reference); eval of the
    saved adapter gives the run's own after-training loss."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "train.max_steps=6", "train.logging_steps=1", "train.eval_steps=3"]
    overrides += ["train.eval_samples=8", "train.global_batch_size=16", "data.max_samples=256"]  # all 200 held out
    done = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", method, f"recipes/tiny_{method}_cpu.yaml", *overrides],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    assert metrics["compiles"]["after_warmup"] == 0, metrics["compiles"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in logged if "loss" in line and "eval_loss" not in line]
    assert set(METHODS[method].metrics) <= set(trained[0]), trained[0]
    if method == "kto":
        assert trained[0]["kl"] == 0 and any(line["kl"] > 0 for line in trained[1:])
    from lowmem_tpu.publish.card import model_card

    card = model_card(out / "final", f"me/tiny-{method}", "adapter")
    assert f"- {method}" in card and f"preference tuning: {method.upper()}, beta" in card
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(out / "final"), "--data", held_out]
    scored = subprocess.run([*evaluate, "--samples", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert json.loads(scored.stdout)["loss"] == pytest.approx(metrics["eval"]["after"]["loss"], abs=1e-4)


def test_memory_measures_the_dpo_step_and_compare_sets_lora_beside_full_parameter_dpo(tmp_path):
    def cli(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        line = [sys.executable, "-m", "lowmem_tpu.cli", command, "recipes/tiny_dpo_cpu.yaml", *args]
        return subprocess.run(line, capture_output=True, text=True, timeout=600)

    measured = cli("memory", "--compile", "--target", "cpu")
    assert measured.returncode == 0, measured.stderr[-2000:]
    assert "the real step compiled in" in measured.stdout
    compared = cli("compare", f"output_dir={tmp_path}")
    assert compared.returncode == 0, compared.stderr[-2000:]
    result = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert result["method"] == "dpo" and "reference log-probabilities are computed once" in compared.stdout
    lora, full = (result["modes"][mode]["measured"] for mode in ("lora", "full"))
    assert lora["fits"] and full["fits"] and full["compiler"]["total_bytes"] > 0
    assert full["compiler_peak"] != lora["compiler_peak"]  # two programs: the full one trains every weight


def test_a_run_from_a_trained_adapter_compares_with_its_frozen_copy_as_trl_does(tmp_path):
    """The SFT -> DPO pipeline (``model.adapter``): the reference is TRL's frozen copy of the starting adapter."""
    base = make_base(tmp_path / "base")
    start = make_adapter(base, tmp_path / "start", r=4, seed=1)
    moved = make_adapter(base, tmp_path / "moved", r=4, seed=2)  # where the policy has gone since
    trl = _trl_on_the_cpu(base, moved, 8, 0.5, "sigmoid", tmp_path / "trl.json", start=start)
    ours = _xla_step(base, moved, 8, 0.5, "sigmoid", tmp_path / "run", start=start)
    assert abs(trl["rewards/margins"]) > 1e-3  # the policy is not its reference
    for key in COMPARED:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4), key


def test_a_run_from_a_trained_adapter_takes_its_settings_and_eval_scores_it_against_that_adapter(tmp_path):
    """SFT -> DPO through the CLI: the recipe takes the starting adapter's LoRA settings, the run starts at
    ln 2 (the policy is its reference), and ``eval`` rebuilds that reference from the starting adapter."""
    base = make_base(tmp_path / "base")
    start = make_adapter(base, tmp_path / "start", r=4, seed=1)
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"model.name_or_path={base}", "model.random_init=false", f"model.adapter={start}"]
    overrides += ["lora.r=16", "train.max_steps=4", "train.logging_steps=2", "train.eval_steps=null"]
    overrides += ["train.eval_samples=8", "train.global_batch_size=16", "data.max_samples=256"]  # eval: every pair
    overrides += ["preference.loss_type=sigmoid", "train.learning_rate=1e-2"]
    done = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", "dpo", "recipes/tiny_dpo_cpu.yaml", *overrides],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    final = out / "final"
    assert "r: 4" in (final / "recipe.yaml").read_text()  # the adapter's rank, not the override's 16
    metrics = json.loads((final / "metrics.json").read_text())
    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(after["reward_margin"]) > 1e-4  # the policy moved away from the adapter it started from
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(final), "--data", held_out, "--samples", "8"]
    scored = subprocess.run([*evaluate, "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    result = json.loads(scored.stdout)
    assert result["loss"] == pytest.approx(after["loss"], abs=1e-4)
    assert result["reward_margin"] == pytest.approx(after["reward_margin"], abs=1e-4)
    assert result["preference_accuracy"] == pytest.approx(after["preference_accuracy"], abs=1e-6)
    (start / "adapter_model.safetensors").unlink()  # its reference gone: refused before any weight loads
    refused = subprocess.run(evaluate, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "its reference, which is not there" in refused.stderr
