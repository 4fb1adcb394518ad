"""Checkpoints and exact resume through the real CLI: SIGTERM, half-written saves, changed recipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

RUN = [
    "train.max_steps=8",
    "train.logging_steps=1",
    "train.global_batch_size=16",
    "train.gradient_accumulation_steps=2",  # SIGTERM usually lands between two micro-batches
    "train.save_steps=2",
    "train.keep_last=2",
    "train.eval_samples=0",
    "data.eval_path=null",
    "lora.dropout=0.1",  # dropout draws from the XLA RNG, which the checkpoint must restore
]


FAKE_TOKEN = "hf_lowmemTestTokenNeverWritten0123456789"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return env | {"PYTHONUNBUFFERED": "1", "HF_TOKEN": FAKE_TOKEN}


def _assert_no_token(root: Path, *outputs: str) -> None:
    for text in outputs:
        assert FAKE_TOKEN not in text
    for path in root.rglob("*"):
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), path


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lowmem_tpu.cli",
        "sft",
        "recipes/tiny_lora_cpu.yaml",
        f"output_dir={out}",
        *RUN,
        *extra,
    ]


def _losses(out: Path) -> dict[int, float]:
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    return {e["step"]: e["loss"] for e in metrics["train"]["losses"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    proc = subprocess.run(_cmd(out), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_one_interrupt_saves_and_resume_is_exact(uninterrupted, tmp_path, signum, code):
    """SIGTERM (a preemption) and a first SIGINT (Ctrl-C, a notebook's interrupt) both save and stop."""
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    for line in proc.stdout:
        if line.startswith("step 3/8"):
            proc.send_signal(signum)
            break
    stdout = "".join(proc.stdout)
    assert proc.wait(timeout=300) == code, proc.stderr.read()[-3000:]
    assert "Run the same command again to resume" in stdout
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all((out / "checkpoints" / name / "COMPLETE").exists() for name in saved)
    assert not (out / "final").exists()

    # What a SIGKILL in the middle of a save leaves behind: ignored, then cleaned up.
    half = out / "checkpoints" / "step-99.partial"
    half.mkdir()
    (half / "trainable.safetensors").write_bytes(b"truncated")

    resumed = subprocess.run(_cmd(out), capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / saved[-1]}" in resumed.stdout
    assert "removed an incomplete checkpoint" in resumed.stdout and not half.exists()
    assert len(list((out / "checkpoints").iterdir())) == 2  # keep_last

    whole, after = _losses(uninterrupted), _losses(out)
    first = int(saved[-1].removeprefix("step-")) + 1
    assert sorted(after) == list(range(first, 9))
    for step, loss in after.items():
        assert loss == pytest.approx(whole[step], abs=1e-6), (step, loss, whole[step])
    a = load_file(str(uninterrupted / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key
    _assert_no_token(out, stdout, resumed.stdout, resumed.stderr)


def test_resume_with_a_changed_recipe_is_refused_with_a_diff(tmp_path):
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, "train.max_steps=2"), capture_output=True, text=True, env=_env(), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "final").rename(out / "final-old")  # keep the checkpoint, clear the finished result
    changed = subprocess.run(_cmd(out, "lora.r=8"), capture_output=True, text=True, env=_env(), timeout=600)
    assert changed.returncode == 2
    assert "lora.r: 16 -> 8" in changed.stderr and "--force-resume" in changed.stderr
    assert "Traceback" not in changed.stderr


def _truncate(checkpoint: Path) -> None:
    shard = checkpoint / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a preempted copy, a disk that filled earlier


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_and_none_left_exits_2(tmp_path):
    out = tmp_path / "run"
    args = ("train.max_steps=4", "train.eval_samples=0")
    first = subprocess.run(_cmd(out, *args), capture_output=True, text=True, env=_env(), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-4" / "MANIFEST.json").is_file()
    (out / "final").rename(out / "final-1")
    _truncate(out / "checkpoints" / "step-4")

    resumed = subprocess.run(_cmd(out, *args), capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: {out / 'checkpoints' / 'step-4'} is damaged (state/__0_0.distcp has 100 bytes" in resumed.stdout
    assert f"resuming from {out / 'checkpoints' / 'step-2'}" in resumed.stdout

    (out / "final").rename(out / "final-2")
    for step in ("step-2", "step-4"):
        _truncate(out / "checkpoints" / step)
    refused = subprocess.run(_cmd(out, *args), capture_output=True, text=True, env=_env(), timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "no whole checkpoint is left" in refused.stderr and "train.resume=never" in refused.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]  # nothing deleted


@pytest.fixture
def small_disk(tmp_path):
    """A filesystem of a few MiB (tmpfs; needs root, as this machine and CI have): mount(size_mib) -> its path."""
    mounted = []

    def mount(size_mib: int) -> Path:
        where = tmp_path / f"disk-{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)], capture_output=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_disk_too_small_for_the_run_is_refused_before_training(small_disk):
    out = small_disk(8) / "run"  # room for the random-init base and the data cache, not for the checkpoints
    proc = subprocess.run(_cmd(out), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "this run (3 more checkpoint(s) of" in proc.stderr and "which has" in proc.stderr
    assert "lower train.keep_last" in proc.stderr and "training 8 steps" not in proc.stdout


def test_a_disk_that_fills_during_the_run_stops_it_at_the_save_with_the_last_checkpoint_whole(small_disk):
    import shutil

    from lowmem_tpu.files import damage

    disk = small_disk(16)
    out = disk / "run"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    for line in proc.stdout:
        if line.startswith("step 3/8"):  # step-2 is saved; fill the disk before the save at step 4
            (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 2**19))
            break
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 2, stderr[-3000:]
    assert "Traceback" not in stderr and "checkpoint step-4 needs" in stderr, stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert damage(out / "checkpoints" / "step-2") is None
    (disk / "filler").unlink()
    resumed = subprocess.run(_cmd(out), capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'step-2'}" in resumed.stdout


def test_the_evaluation_at_resume_scores_the_restored_model(tmp_path):
    """It equals the evaluation the first run made of the same weights at its end (not the untrained model's)."""
    import re

    out = tmp_path / "run"
    args = ("train.max_steps=4", "train.eval_samples=0", "data.eval_path=builtin:reverse/eval.jsonl")
    first = subprocess.run(_cmd(out, *args), capture_output=True, text=True, env=_env(), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    ended = re.search(r"eval after training: loss ([0-9.]+)", first.stdout)
    (out / "final").rename(out / "final-at-4")
    resumed = subprocess.run(
        _cmd(out, *args, "train.max_steps=6"), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    restored = re.search(r"eval at resume \(step-4\): loss ([0-9.]+)", resumed.stdout)
    assert ended and restored and restored.group(1) == ended.group(1), resumed.stdout[-2000:]
    before = re.search(r"eval before training: loss ([0-9.]+)", first.stdout)
    assert before and before.group(1) != restored.group(1)


def test_max_wall_time_saves_and_stops_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(_cmd(out, "train.max_wall_time=5s"), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(max_wall_time)" in proc.stdout
    assert any((p / "COMPLETE").exists() for p in (out / "checkpoints").iterdir())


def test_bad_data_fails_before_loading_and_leaves_output_intact(tmp_path):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "keep.txt").write_text("an earlier result")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": [ oops\n')
    proc = subprocess.run(
        _cmd(out, f"data.path={bad}", "--overwrite"), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert proc.returncode == 2
    assert f"{bad}" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading builtin:tiny-llama" not in proc.stdout
    assert (out / "final" / "keep.txt").read_text() == "an earlier result"


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(uninterrupted, tmp_path):
    out = tmp_path / "run"
    # Saving every step, a kill right after step 3's log line lands in (or just before) its save.
    proc = subprocess.Popen(
        _cmd(out, "train.save_steps=1"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
    )
    for line in proc.stdout:
        if line.startswith("step 3/8"):
            proc.kill()
            break
    proc.wait(timeout=60)
    complete = [p for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").exists()]
    assert complete, "the checkpoints of steps 1-2 were complete before the kill"

    resumed = subprocess.run(_cmd(out, "train.save_steps=1"), capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((out / "checkpoints").glob("*.partial"))
    whole, after = _losses(uninterrupted), _losses(out)
    for step, loss in after.items():
        assert loss == pytest.approx(whole[step], abs=1e-6), (step, loss, whole[step])


# Full fine-tuning, logging every 3 steps: the saves at steps 2 and 4 fall between logs.
FULL = ["lora.enabled=false", "train.learning_rate=1e-3", "train.logging_steps=3"]


@pytest.fixture(scope="module")
def uninterrupted_full(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole-full")
    proc = subprocess.run(_cmd(out, *FULL), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_full_fine_tuning_resumes_exactly_from_a_save_between_logs(uninterrupted_full, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, *FULL), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    for line in proc.stdout:
        if line.startswith("step 3/8"):
            proc.send_signal(signal.SIGTERM)
            break
    "".join(proc.stdout)
    assert proc.wait(timeout=300) == 143, proc.stderr.read()[-3000:]
    assert not (out / "final").exists()
    # The curve of the stopped run was written as it went.
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3]

    resumed = subprocess.run(_cmd(out, *FULL), capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == [3, 6]
    a = load_file(str(uninterrupted_full / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key
