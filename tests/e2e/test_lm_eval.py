"""``eval --tasks``: lm-evaluation-harness's own numbers, offline, on a trained model.

The reference is lm-eval's own command line (``python -m lm_eval``) on the same model directory and task files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_adapter, make_base

from lowmem_tpu.files import damage, write_manifest
from lowmem_tpu.infer.harness import write_builtin_tasks

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# lm-eval's own command line builds its model through accelerate, which takes the XLA device when torch_xla is
# installed: the reference runs in plain PyTorch on the CPU, as ``eval --tasks`` does.
PLAIN = {**ENV, "USE_TORCH_XLA": "0"}


def run(*args: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lm-eval")
    base = make_base(root / "base")  # random weights: scores between chance and 1, where a difference would show
    return base, make_adapter(base, root / "adapter")


def test_scores_equal_lm_evals_own_command_line(models, tmp_path):
    base, _ = models
    ours = run("-m", "lowmem_tpu.cli", "eval", str(base), "--tasks", "builtin:reverse", "--limit", "40", "--json")
    assert ours.returncode == 0, ours.stderr[-3000:]
    record = json.loads(ours.stdout)
    scores = {task: entry["scores"] for task, entry in record["tasks"].items()}
    tasks = write_builtin_tasks(tmp_path)
    theirs = run(
        "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={base},dtype=float32", "--device", "cpu",
        "--tasks", "reverse_choice,reverse_generate", "--include_path", str(tasks), "--limit", "40",
        "--batch_size", "8", "--output_path", str(tmp_path / "results"), env=PLAIN,
    )  # fmt: skip
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]
    assert scores["reverse_choice"]["acc"] == results["reverse_choice"]["acc,none"]
    assert scores["reverse_generate"]["exact_match"] == results["reverse_generate"]["exact_match,none"]
    assert {task: entry["samples"] for task, entry in record["tasks"].items()} == {
        "reverse_choice": 40,
        "reverse_generate": 40,
    }
    assert 0 < scores["reverse_choice"]["acc"] < 1  # a figure a wrong model would move
    assert record["device"] == "cpu" and not record["tasks"]["reverse_choice"]["chat_template"]  # no recipe
    assert json.loads((base / "metrics.json").read_text())["lm_eval"]["tasks"] == record["tasks"]


def test_an_adapters_scores_go_into_its_metrics_and_keep_it_whole(models):
    _, adapter = models
    write_manifest(adapter)  # as a run's final/ has one
    tasks = str(write_builtin_tasks(adapter.parent))
    for task in ("reverse_choice", "reverse_generate"):
        result = run("-m", "lowmem_tpu.cli", "eval", str(adapter), "--tasks", task, "--include-path", tasks,
                     "--limit", "10", "--chat-template")  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"{task}: " in result.stdout
    recorded = json.loads((adapter / "metrics.json").read_text())["lm_eval"]["tasks"]
    assert list(recorded) == ["reverse_choice", "reverse_generate"]  # the second run kept the first's scores
    assert recorded["reverse_choice"]["chat_template"] and recorded["reverse_choice"]["samples"] == 10
    assert damage(adapter) is None  # the manifest was rewritten with the new metrics.json
    from lowmem_tpu.publish.card import model_card

    card = model_card(adapter, "me/tiny", "adapter")
    assert "## Benchmarks" in card and "| reverse_choice | acc " in card and "| 10 | yes |" in card
    assert "--enable-lora --lora-modules tiny=me/tiny --max-lora-rank 8" in card and "--gguf q8_0" in card


def test_bad_input_exits_2(models):
    base, _ = models
    unknown = run("-m", "lowmem_tpu.cli", "eval", str(base), "--tasks", "no_such_task_here")
    assert unknown.returncode == 2 and "lm-eval knows no task no_such_task_here" in unknown.stderr
    both = run("-m", "lowmem_tpu.cli", "eval", str(base), "--tasks", "builtin:reverse", "--data", "x.jsonl")
    assert both.returncode == 2 and "one of them" in both.stderr
    assert "Traceback" not in unknown.stderr + both.stderr
