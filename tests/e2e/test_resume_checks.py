"""Resumes that must be refused or must pass over a checkpoint, full disks, and bad input, through the real CLI.

Three tests start from copies of one finished 4-step run (checkpoints step-2 and step-4, an eval set).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from sft_cli import run, start

pytestmark = pytest.mark.slow

ONE = "train.gradient_accumulation_steps=1"  # a program less to compile; accumulation is test_resume.py's
FOUR = ("train.max_steps=4", "data.eval_path=builtin:reverse/eval.jsonl", ONE)  # data.* must match to resume


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> tuple[Path, str]:
    """A finished 4-step run and its stdout; copy it (``_copy``) before changing it."""
    out = tmp_path_factory.mktemp("four") / "run"
    proc = run(out, *FOUR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    return out, proc.stdout


def _copy(four_steps: tuple[Path, str], tmp_path: Path) -> Path:
    """The finished run, copied, with its final/ moved aside: its checkpoints are what a re-run finds."""
    out = tmp_path / "run"
    shutil.copytree(four_steps[0], out)
    (out / "final").rename(out / "final-0")
    return out


def test_resume_with_a_changed_recipe_is_refused_with_a_diff(four_steps, tmp_path):
    out = _copy(four_steps, tmp_path)
    changed = run(out, *FOUR, "lora.r=8")
    assert changed.returncode == 2
    assert "lora.r: 16 -> 8" in changed.stderr and "--force-resume" in changed.stderr
    assert "Traceback" not in changed.stderr


def _truncate(checkpoint: Path) -> None:
    shard = checkpoint / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a preempted copy, a disk that filled earlier


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_and_none_left_exits_2(four_steps, tmp_path):
    out = _copy(four_steps, tmp_path)
    assert (out / "checkpoints" / "step-4" / "MANIFEST.json").is_file()
    _truncate(out / "checkpoints" / "step-4")

    resumed = run(out, *FOUR)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: {out / 'checkpoints' / 'step-4'} is damaged (state/__0_0.distcp has 100 bytes" in resumed.stdout
    assert f"resuming from {out / 'checkpoints' / 'step-2'}" in resumed.stdout

    (out / "final").rename(out / "final-2")
    for step in ("step-2", "step-4"):
        _truncate(out / "checkpoints" / step)
    refused = run(out, *FOUR)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "no whole checkpoint is left" in refused.stderr and "train.resume=never" in refused.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]  # nothing deleted


def test_the_evaluation_at_resume_scores_the_restored_model_and_max_wall_time_stops_it(four_steps, tmp_path):
    """It equals the evaluation the first run made of the same weights at its end (not the untrained model's).

    The resumed run also sets ``train.max_wall_time`` (a resume may change it): its deadline, with the guard's
    margin, has passed at the first step's end, so the run saves step-5 and stops cleanly (exit 0)."""
    first = four_steps[1]
    ended = re.search(r"eval after training: loss ([0-9.]+)", first)
    out = _copy(four_steps, tmp_path)
    resumed = run(out, *FOUR, "train.max_steps=6", "train.max_wall_time=5s")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    restored = re.search(r"eval at resume \(step-4\): loss ([0-9.]+)", resumed.stdout)
    assert ended and restored and restored.group(1) == ended.group(1), resumed.stdout[-2000:]
    before = re.search(r"eval before training: loss ([0-9.]+)", first)
    assert before and before.group(1) != restored.group(1)
    # step-5, not any checkpoint: the copy already holds step-4; step-5 is the one the stop saved
    assert "(max_wall_time)" in resumed.stdout and (out / "checkpoints" / "step-5" / "COMPLETE").exists()


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
    proc = run(out, ONE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "this run (3 more checkpoint(s) of" in proc.stderr and "which has" in proc.stderr
    assert "lower train.keep_last" in proc.stderr and "training 8 steps" not in proc.stdout


def test_a_disk_that_fills_during_the_run_stops_it_at_the_save_with_the_last_checkpoint_whole(small_disk):
    from lowmem_tpu.files import damage

    disk = small_disk(16)
    out = disk / "run"
    proc = start(out, ONE)
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
    resumed = run(out, ONE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'step-2'}" in resumed.stdout


def test_bad_data_fails_before_loading_and_leaves_output_intact(tmp_path):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "keep.txt").write_text("an earlier result")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": [ oops\n')
    proc = run(out, f"data.path={bad}", "--overwrite")
    assert proc.returncode == 2
    assert f"{bad}" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading builtin:tiny-llama" not in proc.stdout
    assert (out / "final" / "keep.txt").read_text() == "an earlier result"
