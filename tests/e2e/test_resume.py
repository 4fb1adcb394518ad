"""Exact resume through the real CLI after a preemption (SIGTERM) or an interrupt (SIGINT), LoRA, full and DPO.

What a SIGKILL leaves (inside a save, before a rename) is ``test_faults.py``'s; refused and damaged
resumes, full disks and bad data are ``test_resume_checks.py``'s.
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    proc = run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


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


def test_sigterm_saves_and_the_same_command_resumes_exactly(uninterrupted, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = _stop_at_step_3(out, signal.SIGTERM)
    assert code == 143, stderr[-3000:]
    assert "Run the same command again to resume" in stdout
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all((out / "checkpoints" / name / "COMPLETE").exists() for name in saved)
    assert not (out / "final").exists()

    # What a SIGKILL in the middle of a save leaves behind: ignored, then cleaned up.
    half = out / "checkpoints" / "step-99.partial"
    half.mkdir()
    (half / "trainable.safetensors").write_bytes(b"truncated")

    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / saved[-1]}" in resumed.stdout
    assert "removed an incomplete checkpoint" in resumed.stdout and not half.exists()
    assert len(list((out / "checkpoints").iterdir())) == 2  # keep_last

    whole, after = losses(uninterrupted), losses(out)
    first = int(saved[-1].removeprefix("step-")) + 1
    assert sorted(after) == list(range(first, 9))
    for step, loss in after.items():
        assert loss == pytest.approx(whole[step], abs=1e-6), (step, loss, whole[step])
    a = load_file(str(uninterrupted / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key
    assert_no_token(out, stdout, resumed.stdout, resumed.stderr)


def test_one_interrupt_saves_and_stops_like_a_preemption(tmp_path):
    """A first SIGINT (Ctrl-C, a notebook's interrupt) takes SIGTERM's path: a whole checkpoint, exit 130."""
    out = tmp_path / "run"
    code, stdout, stderr = _stop_at_step_3(out, signal.SIGINT)
    assert code == 130, stderr[-3000:]
    assert "Run the same command again to resume" in stdout and "Traceback" not in stderr
    saved = list((out / "checkpoints").iterdir())
    assert saved and all((p / "COMPLETE").exists() for p in saved)
    assert not (out / "final").exists()


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
    code, _, stderr = _stop_at_step_3(out, signal.SIGTERM, *FULL)
    assert code == 143, stderr[-3000:]
    assert not (out / "final").exists()
    # The curve of the stopped run was written as it went.
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3]

    resumed = run(out, *FULL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3, 6]
    a = load_file(str(uninterrupted_full / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key


def test_a_full_parameter_dpo_run_stopped_by_sigterm_resumes_exactly(tmp_path):
    """Full-parameter DPO saves at the step boundary and resumes on the same losses (TRL's, read on the host),
    its reference computed again from the starting model before the checkpoint is loaded (held-out pairs on:
    the checkpoint is loaded before they are scored at resume). LoRA DPO's resume: test_faults.py."""
    extra = ("lora.enabled=false", "data.eval_path=builtin:reverse/prefer_eval.jsonl", "data.max_samples=256")
    whole = tmp_path / "whole"
    assert run(whole, *extra, command=DPO).returncode == 0
    out = tmp_path / "run"
    code, stdout, stderr = _stop_at_step_3(out, signal.SIGTERM, *extra, command=DPO)
    assert code == 143 and "Run the same command again to resume" in stdout, stderr[-3000:]
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
