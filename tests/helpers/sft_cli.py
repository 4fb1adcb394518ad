"""The tiny recipe through the real CLI, one subprocess per run, as the resume tests run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fault_matrix as matrix

# The fault matrix's runs (checkpoints every 2 steps, two kept, 2 micro-batches a step: SIGTERM usually lands
# between them, dropout from the XLA RNG a checkpoint must restore), 8 steps long, reading the 16 x 8 records
# they train on and no more.
RUN = [*(o for o in matrix.RUN if not o.startswith("train.max_steps=")), "train.max_steps=8", "data.max_samples=512"]

FAKE_TOKEN = "hf_lowmemTestTokenNeverWritten0123456789"


def env() -> dict[str, str]:
    kept = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return kept | {"PYTHONUNBUFFERED": "1", "HF_TOKEN": FAKE_TOKEN}


SFT = ("sft", "recipes/tiny_lora_cpu.yaml")
DPO = ("dpo", "recipes/tiny_dpo_cpu.yaml", "preference.loss_type=sigmoid", "train.eval_steps=null")


def cmd(out: Path, *extra: str, command: tuple[str, ...] = SFT) -> list[str]:
    """``command``: the subcommand, its recipe and the overrides that make it this module's run."""
    verb, recipe, *fixed = command
    return [sys.executable, "-m", "lowmem_tpu.cli", verb, recipe, f"output_dir={out}", *RUN, *fixed, *extra]


def run(out: Path, *extra: str, command: tuple[str, ...] = SFT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd(out, *extra, command=command), capture_output=True, text=True, env=env(), timeout=600)


def start(out: Path, *extra: str, command: tuple[str, ...] = SFT) -> subprocess.Popen[str]:
    argv = cmd(out, *extra, command=command)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())


def losses(out: Path) -> dict[int, float]:
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    return {e["step"]: e["loss"] for e in metrics["train"]["losses"]}


def assert_no_token(root: Path, *outputs: str) -> None:
    for text in outputs:
        assert FAKE_TOKEN not in text
    for path in root.rglob("*"):
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), path
