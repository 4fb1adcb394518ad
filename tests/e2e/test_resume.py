"""Exact resume through the real CLI after a preemption (SIGTERM) or an interrupt (SIGINT): full fine-tuning
and full-parameter DPO.

LoRA's exact resume (dropout, 2 micro-batches a step) is ``test_faults.py``'s, with what a SIGKILL leaves (inside
a save, before a rename): a checkpoint saved on a signal and one saved on schedule are the same save. Refused and
damaged resumes, full disks and bad data are ``test_resume_checks.py``'s.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_cli import DPO, assert_no_token, losses, run, start

pytestmark = pytest.mark.slow


def _stop_at_step_3(
    out: Path, signum: int, *extra: str, command: tuple[str, ...] | None = None
) -> tuple[int, str, str]:
    proc = start(out, *extra, **({"command": command} if command else {}))
    for line in proc.stdout:
        if line.startswith("step 3/8"):
            proc.send_signal(signum)
            break
    stdout = "".join(proc.stdout)
    code = proc.wait(timeout=300)
    return code, stdout, proc.stderr.read()


# Full fine-tuning, logging every 3 steps: the saves at steps 2 and 4 fall between logs.
FULL = ["lora.enabled=false", "train.learning_rate=1e-3", "train.logging_steps=3"]


@pytest.fixture(scope="module")
def uninterrupted_full(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole-full")
    proc = run(out, *FULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_full_fine_tuning_resumes_exactly_from_a_save_between_logs(uninterrupted_full, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = _stop_at_step_3(out, signal.SIGTERM, *FULL)
    assert code == 143, stderr[-3000:]
    assert "Run the same command again to resume" in stdout
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all((out / "checkpoints" / name / "COMPLETE").exists() for name in saved)
    assert not (out / "final").exists()
    # The curve of the stopped run was written as it went.
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3]

    resumed = run(out, *FULL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / saved[-1]}" in resumed.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3, 6]
    a = load_file(str(uninterrupted_full / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key
    assert_no_token(out, stdout, stderr, resumed.stdout, resumed.stderr)  # HF_TOKEN is set (sft_cli.env)


def test_a_full_parameter_dpo_run_stopped_by_an_interrupt_resumes_exactly(tmp_path):
    """A first SIGINT (Ctrl-C, a notebook's interrupt) takes SIGTERM's path (every training command's handler):
    full-parameter DPO saves at the step boundary, exits 130, and resumes on the same losses (TRL's, read on the
    host), its reference computed again from the starting model before the checkpoint is loaded (held-out pairs
    on: the checkpoint is loaded before they are scored at resume). LoRA DPO's checkpoints are LoRA's
    (test_faults.py); LoRA DPO killed at every fault point: ``benchmarks/fault_matrix.py --modes dpo``."""
    extra = ("lora.enabled=false", "data.eval_path=builtin:reverse/prefer_eval.jsonl", "data.max_samples=256")
    whole = tmp_path / "whole"
    assert run(whole, *extra, command=DPO).returncode == 0
    out = tmp_path / "run"
    code, stdout, stderr = _stop_at_step_3(out, signal.SIGINT, *extra, command=DPO)
    assert code == 130, stderr[-3000:]
    assert "Run the same command again to resume" in stdout and "Traceback" not in stderr
    saved = list((out / "checkpoints").iterdir())
    assert saved and all((p / "COMPLETE").exists() for p in saved)
    assert not (out / "final").exists()
    resumed = run(out, *extra, command=DPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert "reference log-probabilities of" in resumed.stdout
    # scored at resume against the starting model, not against the restored weights
    at_resume = json.loads((out / "final" / "metrics.json").read_text())["eval"]["before"]
    assert abs(at_resume["reward_margin"]) > 1e-5 and at_resume["preference_accuracy"] > 0
    after, before = losses(out), losses(whole)
    assert after and all(loss == before[step] for step, loss in after.items())  # the resumed steps', bit for bit
    a = load_file(str(whole / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert json.loads((out / "final" / "metrics.json").read_text())["compiles"]["after_warmup"] == 0
