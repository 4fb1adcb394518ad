"""The README's main command: the embedded default learns its task (CLI, fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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

    # The persistent compile cache was written; a second run finds it but, on the CPU backend of
    # torch_xla 2.9, cannot deserialize it: it compiles again and says so once, without a warning wall.
    cache = Path(metrics["compiles"]["persistent_cache"]["dir"])
    assert cache.is_dir() and any(cache.iterdir())
    again = subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", "sft", f"output_dir={tmp_path / 'again'}", "train.max_steps=3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("could not be read back") == 1
    assert "Failed to deserialize" not in again.stderr
    cached = json.loads((tmp_path / "again" / "final" / "metrics.json").read_text())["compiles"]["persistent_cache"]
    assert cached["unreadable"] > 0 and cached["dir"] == str(cache)
