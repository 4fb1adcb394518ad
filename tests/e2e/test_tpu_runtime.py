"""What the XLA runtime says about TPUs: why torch_xla cannot answer under SPMD (on the CPU), and the
``tpu``-marked tests that run the shared functions on a TPU and fail if a figure comes back empty (the CPU
paths themselves: unit/test_tpu_facts.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_tpu.config import RuntimeSection, load_recipe
from lowmem_tpu.config.devices import generation_of

ROOT = Path(__file__).resolve().parents[2]


def test_torch_xla_gives_neither_kind_nor_memory_under_spmd():
    """Why the kind comes from the PCI bus and HBM from libtpu: both torch_xla calls refuse SPMD's device."""
    import torch_xla.core.xla_model as xm

    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="cpu"))
    with pytest.raises(RuntimeError, match="Unknown device SPMD:0"):
        xm.xla_device_kind()
    with pytest.raises(RuntimeError, match="SPMD virtual device"):
        xm.get_memory_info()
    assert runtime.kind == "cpu" and runtime.peak_flops is None
    assert runtime.monitor is None and runtime.memory_per_device() == []


# ----------------------------------------------------------------------------- on a TPU


@pytest.mark.tpu
def test_tpu_kind_peak_flops_and_hbm_under_spmd():  # pragma: no cover - TPU only
    import torch

    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="tpu"))
    assert generation_of(runtime.kind) is not None, runtime.kind
    assert runtime.peak_flops and runtime.peak_flops > 1e14
    before = runtime.monitor.sample()
    assert before, runtime.monitor.error
    import torch_xla

    block = torch.ones(2**28, device=runtime.device)  # 1 GiB, replicated: on every device
    torch_xla.sync()
    after = runtime.monitor.sample()
    assert all(a.used >= b.used + 2**30 * 0.9 for a, b in zip(after, before, strict=True))
    assert all(0 < a.used < a.limit for a in after) and len(after) == runtime.num_devices
    del block


@pytest.mark.tpu
def test_tpu_run_records_mfu_and_measured_memory(tmp_path):  # pragma: no cover - TPU only
    from lowmem_tpu.doctor import _sft

    metrics, error = _sft(tmp_path / "run", tmp_path / "cache", 8, 1200)
    assert metrics is not None, error
    assert metrics["train"]["steady_mfu"] and metrics["train"]["steady_mfu"] > 0
    figures = metrics["memory"]["per_device_gib"]
    assert figures["measured_peak"] > 0 and figures["planned_peak"] > 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(line.get("memory_per_device") for line in lines) and any("memory_peak_gib" in line for line in lines)


@pytest.mark.tpu
def test_tpu_compiler_refusal_is_a_result_not_a_crash():  # pragma: no cover - TPU only
    from lowmem_tpu.measure.local import compile_step

    overrides = ["runtime.device=tpu", "data.max_length=512", "train.global_batch_size=16384"]
    overrides += ["sharding.activation_checkpointing=false", "data.eval_path=null", "train.eval_samples=0"]
    recipe = load_recipe(ROOT / "recipes/tiny_lora_cpu.yaml", overrides)
    step = compile_step(recipe, 1, platform="TPU", timeout=1800)
    assert step.out_of_memory is not None and step.compiler is None
    assert step.out_of_memory.needed_bytes > step.out_of_memory.capacity_bytes > 0


@pytest.mark.tpu
def test_doctor_passes_on_a_tpu(tmp_path):  # pragma: no cover - TPU only
    out = tmp_path / "doctor.json"
    done = subprocess.run([sys.executable, "-m", "lowmem_tpu.cli", "doctor", "--out", str(out)], capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-3000:]
    report = json.loads(out.read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status["MFU"] == "ok" and status["memory per device"] == "ok" and status["compile cache reuse"] == "ok"
    assert status["TPU runtime"] == status["flash attention"] == status["libtpu"] == "ok"
