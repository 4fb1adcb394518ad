"""``python -m lowmem_tpu.cli ARGS`` in a subprocess, as the unit and e2e modules of one topic both run it.

One function per topic (its own environment and time limit); the modules import it as ``cli``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command_cli(*args: str, importtime: bool = False, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lowmem_tpu.cli ARGS`` (from the repository root unless ``cwd``) on the CPU backend."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def memory_cli(*args: str, importtime: bool = False, device: str = "CPU") -> subprocess.CompletedProcess[str]:
    """The memory planner's commands (test_memory_plan, test_memory)."""
    env = {**os.environ, "PJRT_DEVICE": device, "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def compiler_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``memory --compile`` and its refusals (the TPU compiler's modules)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


PLOT_ENV = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}


def plot_cli(*args: str, python: tuple[str, ...] = ("-m", "lowmem_tpu.cli")) -> subprocess.CompletedProcess[str]:
    """``sft`` and ``plot`` as a user runs them, the backend left to the recipe (test_plot, test_plot_run)."""
    return subprocess.run([sys.executable, *python, *args], capture_output=True, text=True, env=PLOT_ENV, timeout=600)
