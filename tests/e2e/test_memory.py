"""The memory planner against real measurements: the CPU compiler on the tiny recipe, LoRA, full and a
quantized base, and a TPU's runtime peak (the planner's arithmetic: unit/test_memory_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import memory_cli as cli

from lowmem_tpu.config import load_recipe
from lowmem_tpu.memory import advise as memory_report
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[2]


def test_memory_compile_for_the_cpu_compiles_the_real_step_beside_the_plan():
    done = cli(
        "memory", "recipes/tiny_lora_cpu.yaml", "train.chunked_loss=true", "--compile", "--target", "cpu", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout)["compiled"]
    assert measured["platform"] == "CPU" and measured["devices"] == 4 and measured["layout"] == "cpu"
    assert measured["measured_peak_bytes"] > measured["measured"]["state"]["weights"] > 0
    assert abs(measured["planner_error"]) < 0.15, measured
    assert "compiling the real training step on 4 CPU devices" in done.stderr


@pytest.mark.slow
def test_compare_on_the_cpu_compiler_matches_the_planner(tmp_path):
    """The real step of the tiny recipe, LoRA and full, compiled for 4 CPU devices: planner vs compiler."""
    done = cli("compare", "recipes/tiny_lora_cpu.yaml", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU compiler" in done.stdout and "not run" in done.stdout
    result = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("lora", "full"):
        mode = result["modes"][name]
        measured, planned = mode["measured"], mode["planned"]
        assert measured["devices"] == 4 and mode["layout"] == "cpu"
        assert abs(planned["peak"] / measured["peak"] - 1) < 0.15, (name, planned["peak"], measured["peak"])
        persistent = sum(measured["segments"][k] for k in ("weights", "optimizer", "gradients"))
        planned_persistent = sum(planned["segments"][k] for k in ("weights", "optimizer", "gradients"))
        assert abs(planned_persistent / persistent - 1) < 0.02, (name, planned_persistent, persistent)
        assert measured["compiler"]["total_bytes"] == measured["peak"] > measured["compiler"]["temp_bytes"] > 0


@pytest.mark.tpu
def test_compare_on_a_tpu_reads_the_runtime_peak(tmp_path):  # pragma: no cover - TPU only
    args = ("compare", "recipes/tiny_lora_cpu.yaml", "runtime.device=tpu", "--steps", "3", "--out", str(tmp_path))
    done = cli(*args, device="TPU")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "compare.json").read_text())
    for mode in ("lora", "full"):
        measured = result["modes"][mode]["measured"]
        assert measured["tokens_per_second"] > 0 and measured["fits"]
        assert measured["runtime_peak"] > 0 and measured["compiler_peak"] > 0, measured["source"]
        assert "runtime" in measured["source"] and len(measured["per_device"]) == measured["devices"]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_base_on_the_cpu_compiler_matches_the_planner(quantize):
    """The tiny recipe's real step with a quantized base, compiled for 4 CPU devices: planner vs compiler."""
    from lowmem_tpu.measure.local import compile_step

    recipe = load_recipe(ROOT / "recipes/tiny_lora_cpu.yaml", [f"model.quantize={quantize}"])
    measured = compile_step(recipe, 4)
    planned = memory_report.plan_recipe(recipe, "cpu", require_config(recipe)).plan
    assert planned.dequantized > 0
    state = measured.state
    assert planned.weights == state.weights and planned.gradients == state.gradients  # exact, integers included
    assert planned.optimizer == state.optimizer
    assert planned.total_parameters == state.total_parameters  # logical count: an int4 byte is two weights
    assert abs(planned.peak / measured.compiler.total_bytes - 1) < 0.15, (planned.peak, measured.compiler.total_bytes)
