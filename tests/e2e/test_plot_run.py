"""The loss curve: ``sft`` draws ``final/loss.png``; ``lowmem-tpu plot`` draws a finished or running run's
(refusals and the log's summary: unit/test_plot.py)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest
from cli_runs import plot_cli as cli

QUICK = [
    "train.max_steps=6",
    "train.logging_steps=1",
    "train.eval_steps=3",  # eval loss at steps 3 and 6
    "train.eval_samples=0",  # no exact-match generation: this is about the curve
    "train.global_batch_size=16",
    "train.warmup_steps=2",
]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header (its signature and IHDR chunk checked)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def assert_sane_png(path: Path) -> None:
    width, height = png_size(path)
    assert 400 <= width <= 2000 and 400 <= height <= 2000, (width, height)
    assert path.stat().st_size > 10_000  # axes, lines and text, not an empty canvas


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A real tiny LoRA run through the command line: its metrics.jsonl and final/."""
    out = tmp_path_factory.mktemp("plot") / "run"
    return out, cli("sft", f"output_dir={out}", *QUICK)


@pytest.mark.slow
def test_sft_ends_with_final_loss_png(run):
    out, proc = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"loss curve: {out / 'final' / 'loss.png'}" in proc.stdout
    assert_sane_png(out / "final" / "loss.png")
    assert not list((out / "final").glob(".*partial"))


@pytest.mark.slow
def test_plot_draws_a_finished_run_from_its_output_dir_or_final(run, tmp_path):
    out, _ = run
    proc = cli("plot", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out / 'loss.png'}: 6 steps (finished), last loss ")
    assert_sane_png(out / "loss.png")

    proc = cli("plot", str(out / "final"), "--out", str(tmp_path / "curve.png"), "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["path"] == str(tmp_path / "curve.png") and shown["run_dir"] == str(out.resolve())
    assert_sane_png(tmp_path / "curve.png")
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e["eval_loss"] for e in logged if "eval_loss" in e]
    assert shown["steps"] == 6 and shown["logs"] == 6 and shown["finished"]
    assert shown["last_loss"] == metrics["train"]["final_loss"] and shown["last_loss_step"] == 6
    assert len(evals) >= 2 and shown["best_eval_loss"] == min(evals)


@pytest.mark.slow
def test_plot_draws_a_run_still_going(run, tmp_path):
    """Mid-run the file ends at some log, perhaps in the middle of a line being written."""
    out, _ = run
    going = tmp_path / "going"
    going.mkdir()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    (going / "checkpoints" / "step-2").mkdir(parents=True)
    proc = cli("plot", str(going / "checkpoints" / "step-2"))  # a checkpoint names its run too
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {going / 'loss.png'}: 3 steps (running or stopped), last loss ")
    assert_sane_png(going / "loss.png")
