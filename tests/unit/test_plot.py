"""The loss curve: ``lowmem-tpu plot``'s refusals and the summary of a log (drawing a real run's curve:
e2e/test_plot_run.py)."""

from __future__ import annotations

import json

import pytest
from cli_runs import plot_cli as cli

from lowmem_tpu.errors import UserError
from lowmem_tpu.train.plot import find_run, plot_finished_run, summarize


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
