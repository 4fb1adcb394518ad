"""``lowmem-tpu dpo`` against TRL itself: on the same tiny model, pairs and LoRA weights, the loss and rewards
the XLA step computes (4 virtual devices, FSDP, the rows at their static shape) equal TRL's DPOTrainer on plain
CPU PyTorch (its own tokenization and padding) within 1e-4, and so do the adapters' gradients; a run from fresh
adapters starts at ln 2 with every reward 0 (to float rounding), compiles nothing after warm-up, and writes an
adapter that is merged and carded as any run's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from preference_steps import PAIRS, trl_dpo_on_the_cpu, xla_step
from tiny_models import make_adapter, make_base, moved_model

from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.config.preference_fields import DPO_LOSSES

COMPARED = ("loss", *METHODS["dpo"].metrics)


@pytest.mark.parametrize(
    ("losses", "options"),
    [
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
    ids=["rpo-weighted-js", "every-loss", "alpha-wpo-ld"],
)
def test_the_xla_step_computes_trls_loss_and_rewards(tmp_path, losses, options):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", r=4)  # B not zero: the policy is not the reference
    trl = trl_dpo_on_the_cpu(base, adapter, 8, 0.5, losses, tmp_path / "trl.json", options=options)
    ours = xla_step(base, adapter, 8, 0.5, losses.replace(",", ", "), tmp_path / "run", options=options)
    assert abs(trl["rewards/margins"]) > 1e-3  # a batch where policy and reference differ
    for key in COMPARED:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4), key
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():  # every adapter's gradient, as TRL computes it
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


def test_full_parameter_dpo_reads_the_precomputed_reference_as_trl_does(tmp_path):
    """Full-parameter DPO: TRL's ``precompute_ref_log_probs`` (the reference computed by the model before
    training), then the policy moved; loss, rewards and every weight's gradient equal TRL's on the CPU."""
    base = make_base(tmp_path / "base")
    moved = moved_model(base, tmp_path / "moved")
    trl = trl_dpo_on_the_cpu(base, moved, 8, 0.5, "sigmoid", tmp_path / "trl.json")
    ours = xla_step(base, moved, 8, 0.5, "sigmoid", tmp_path / "run")
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
    # the two passes of one program agree to float rounding (the ties TRL's strict ">" then counts are noise)
    assert abs(before["reward_margin"]) < 1e-6
    assert metrics["compiles"]["after_warmup"] == 0, metrics["compiles"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in line and "tokens_per_second" in line for line in logged)
    assert any("eval_rewards/accuracies" in line for line in logged)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert "pref acc" in done.stdout and "margin" in done.stdout
    assert "reference log-probabilities" not in done.stdout  # LoRA's reference: the base, adapters switched off
    # Published as any run (merged as any adapter): the card says DPO
    from lowmem_tpu.publish.card import model_card

    card = model_card(out / "final", "me/tiny-dpo", "adapter")
    assert "- dpo" in card and "preference tuning: DPO, beta 0.1, loss sigmoid (TRL DPOTrainer's loss, " in card
    assert "| preference accuracy | " in card and "lowmem-tpu dpo recipe.yaml" in card
    # eval scores the saved adapter as the run scored its held-out pairs after training
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(out / "final"), "--data", held_out]
    scored = subprocess.run([*evaluate, "--samples", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    after, result = metrics["eval"]["after"], json.loads(scored.stdout)
    assert result["loss"] == pytest.approx(after["loss"], abs=1e-4)
    assert result["preference_accuracy"] == pytest.approx(after["preference_accuracy"], abs=1e-6)
    assert result["exact_match"] == after["exact_match"]


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
    trl = trl_dpo_on_the_cpu(base, moved, 8, 0.5, "sigmoid", tmp_path / "trl.json", start=start)
    ours = xla_step(base, moved, 8, 0.5, "sigmoid", tmp_path / "run", start=start)
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
