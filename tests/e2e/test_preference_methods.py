"""ORPO, CPO, SimPO and KTO against TRL's own trainers: on the same tiny model, rows and LoRA weights, the loss,
every figure TRL logs and every adapter's gradient of the XLA step (4 virtual devices, FSDP, static shapes)
equal TRL's ORPOTrainer, CPOTrainer and KTOTrainer on plain CPU PyTorch; ORPO and KTO runs of the tiny demo
log TRL's figures and compile nothing after warm-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from preference_steps import PAIRS, trl_on_given_rows, xla_step
from safetensors.torch import load_file
from tiny_models import make_adapter, make_base, moved_model

from lowmem_tpu.config.methods import METHODS


@pytest.mark.parametrize(
    ("method", "loss", "options"),
    [
        ("orpo", "sigmoid", {}),
        ("cpo", "hinge", {"alphapo_alpha": 0.2}),  # AlphaPO's rewards
        ("simpo", "sigmoid", {"simpo_gamma": 0.3, "label_smoothing": 0.1}),
    ],
    ids=["orpo", "cpo-hinge-alphapo", "simpo"],
)
def test_the_reference_free_methods_compute_trls_loss_metrics_and_gradients(tmp_path, method, loss, options):
    """ORPO, CPO and SimPO on the devices (one policy pass, no reference) against TRL's ORPOTrainer and
    CPOTrainer on plain CPU PyTorch, fed the same rows: loss, every figure TRL logs, every adapter's gradient."""
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", r=4)
    ours = xla_step(base, adapter, 8, 0.5, loss, tmp_path / "run", options=options, method=method)
    trl_options = {"beta": 0.5, **{k.removeprefix("alphapo_"): v for k, v in options.items()}}
    if method == "cpo":
        trl_options["loss_type"] = loss
    trl = trl_on_given_rows(
        method, base, adapter, tmp_path / "run" / "rows.safetensors", trl_options, tmp_path / "trl.json"
    )
    assert sorted(trl) == sorted(("loss", *METHODS[method].metrics))  # the table lists what TRL logs
    for key in trl:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4, rel=1e-4), key
    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():
        # AlphaPO's rewards (exp(-alpha x log p) of summed log-probs) put fp32's rounding at ~2e-5 of gradients ~1.5
        atol = 3e-5 if options.get("alphapo_alpha") else 1e-5
        assert torch.allclose(ours["grads"][name], grad, atol=atol, rtol=1e-3), name


@pytest.mark.parametrize(
    ("picks", "options", "full"),
    [
        ([0, 1, 2, 8, 9, 10, 11, 12], {"desirable_weight": 1.5}, False),  # 3 desirable, 5 undesirable rows
        (list(range(8)), {}, True),  # every row desirable; full-parameter, the reference precomputed
        (list(range(8, 16)), {"undesirable_weight": 0.7, "kto_loss": "apo_zero_unpaired"}, False),  # no KL term
    ],
    ids=["mixed", "all-desirable-full-precomputed", "all-undesirable-apo"],
)
def test_kto_computes_trls_loss_metrics_and_gradients(tmp_path, picks, options, full):
    """KTO on the devices (policy and reference on the rows and the KL rows, one program) against TRL's
    KTOTrainer on plain CPU PyTorch, fed the same rows: loss, every figure TRL logs (those it logs for the batch),
    every trainable weight's gradient. 8 pairs read as KTO: rows 0-7 desirable (the chosen), 8-15 undesirable.
    Full-parameter: the reference precomputed by the starting model over every row and its fixed KL row, equal to
    TRL's ``compute_ref_log_probs``, then the policy moved (KL > 0)."""
    base = make_base(tmp_path / "base")
    adapter = moved_model(base, tmp_path / "moved") if full else make_adapter(base, tmp_path / "adapter", r=4)
    ours = xla_step(base, adapter, 8, 0.5, "sigmoid", tmp_path / "run", options=options, method="kto", picks=picks)
    trl_options = {"beta": 0.5, **{("loss_type" if k == "kto_loss" else k): v for k, v in options.items()}}
    trl = trl_on_given_rows(
        "kto", base, adapter, tmp_path / "run" / "rows.safetensors", trl_options, tmp_path / "trl.json"
    )
    if full:
        fed = load_file(str(tmp_path / "run" / "rows.safetensors"))
        for key in ("ref_logps", "ref_KL_logps"):
            assert torch.allclose(fed[key], torch.tensor(trl.pop(key)), atol=1e-5, rtol=1e-5), key
        assert trl["kl"] > 1e-4  # the policy has moved from its reference
    logged = {key for key in ours if key in METHODS["kto"].metrics or key == "loss"}
    assert logged == set(trl)  # what a batch without desirable (or undesirable) rows leaves out, left out alike
    for key in trl:
        assert ours[key] == pytest.approx(trl[key], abs=1e-4, rel=1e-4), key
    expected = load_file(str(tmp_path / "trl.json.grads.safetensors"))
    assert sorted(ours["grads"]) == sorted(expected) and expected
    for name, grad in expected.items():
        assert torch.allclose(ours["grads"][name], grad, atol=1e-5, rtol=1e-3), name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_orpo_and_kto_runs_log_trls_figures_and_compile_nothing_after_warm_up(tmp_path, method):
    """``lowmem-tpu orpo`` and ``kto`` on the tiny demo: TRL's figures in metrics.jsonl, nothing compiled after
    warm-up; KTO's KL estimate 0 at the first step (fresh adapters: the policy is its reference); eval of the
    saved ORPO adapter gives the run's own after-training loss."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "train.max_steps=4", "train.logging_steps=1", "train.eval_steps=null"]
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
    if method == "kto":  # eval's reference path is DPO's, checked in test_dpo.py: ORPO's reference-free one here
        return
    held_out = str(PAIRS.with_name("prefer_eval.jsonl"))
    evaluate = [sys.executable, "-m", "lowmem_tpu.cli", "eval", str(out / "final"), "--data", held_out]
    scored = subprocess.run([*evaluate, "--samples", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert json.loads(scored.stdout)["loss"] == pytest.approx(metrics["eval"]["after"]["loss"], abs=1e-4)
