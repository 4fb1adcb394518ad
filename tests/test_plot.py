"""The loss curve: ``sft`` draws ``final/loss.png``; ``lowmem-tpu plot`` draws a finished or running run's."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_tpu.errors import UserError
from lowmem_tpu.train.plot import find_run, plot_finished_run, summarize

ENV = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
QUICK = [
    "train.max_steps=6",
    "train.logging_steps=1",
    "train.eval_steps=3",  # eval loss at steps 3 and 6
    "train.eval_samples=0",  # no exact-match generation: this is about the curve
    "train.global_batch_size=16",
    "train.warmup_steps=2",
]


def cli(*args: str, python: tuple[str, ...] = ("-m", "lowmem_tpu.cli")) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *python, *args], capture_output=True, text=True, env=ENV, timeout=600)


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


def test_plot_without_metrics_exits_2_naming_the_file(tmp_path):
    for missing in (tmp_path, tmp_path / "nowhere"):
        proc = cli("plot", str(missing))
        assert proc.returncode == 2
        assert "metrics.jsonl" in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"error: {missing} ")


def test_without_matplotlib_plot_says_so_in_one_line_and_sft_goes_on(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "learning_rate": 1e-3}) + "\n")
    hidden = "import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'lowmem-tpu'; "
    plot = "from lowmem_tpu.cli import main; sys.argv[1:1] = ['plot']; main()"
    proc = cli(str(tmp_path), python=("-c", hidden + plot))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: matplotlib is not installed: pip install -c constraints.txt matplotlib (the [plot] extra)"
    ]
    # What sft does with the same failure: one line, no exception.
    check = "from lowmem_tpu.train.plot import plot_finished_run as p; print(p(sys.argv[1], sys.argv[1]))"
    proc = cli(str(tmp_path), python=("-c", hidden + check))
    assert proc.returncode == 0 and proc.stdout.startswith("no loss curve: matplotlib is not installed")


def test_a_failed_drawing_is_a_line_not_an_exception(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "final").write_text("a file where the folder should be")
    message = plot_finished_run(tmp_path, tmp_path / "final")
    assert message.startswith("no loss curve: drawing it failed (")


def test_find_run_and_summary_of_a_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert find_run(tmp_path / "metrics.jsonl") == tmp_path
    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    assert find_run(deep.parent) == tmp_path.resolve()
    with pytest.raises(UserError, match=r"holds no metrics\.jsonl"):
        find_run(deep)  # four levels down: not taken for this run
    entries = [
        {"step": 2, "loss": 3.0},
        {"step": 2, "eval_loss": 2.5},
        {"step": 4, "loss": 2.0},
        {"step": 4, "eval_loss": 2.7},
        {"step": 4, "train_runtime": 1.0, "train_loss": 2.5},
    ]
    assert summarize(entries) == {
        "steps": 4,
        "logs": 2,
        "last_loss": 2.0,
        "last_loss_step": 4,
        "best_eval_loss": 2.5,
        "best_eval_step": 2,
        "finished": True,
    }
