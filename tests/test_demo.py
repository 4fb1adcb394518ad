"""The README's main command: the embedded default learns its task (CLI, fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_embedded_default_learns_to_reverse_strings(tmp_path):
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    # No recipe argument: `lowmem-tpu sft` runs the embedded default.
    proc = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", "sft", f"output_dir={out}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary" in proc.stdout and "exact match" in proc.stdout
    assert "GSPMD sharding propagation" not in proc.stderr
    assert "Traceback" not in proc.stderr

    metrics = json.loads((out / "final" / "metrics.json").read_text())
    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    assert before["exact_match"] <= 0.05
    assert after["exact_match"] >= 0.8, after
    assert after["loss"] < before["loss"] - 1.0
    assert metrics["compiles"]["after_warmup"] == 0
    assert (out / "final" / "adapter_model.safetensors").exists()
