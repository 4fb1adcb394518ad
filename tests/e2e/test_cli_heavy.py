"""The real command line in a subprocess, for the commands that take seconds: ``validate`` checking a shipped
recipe's model (by path and by name), a second ``sft`` into an output_dir another process holds, and Ctrl-C in a
long command (the quick ones: unit/test_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml
from cli_runs import ROOT
from cli_runs import command_cli as cli


def test_validate_a_shipped_recipe():
    result = cli("validate", "recipes/open_llama_lora.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: recipes/open_llama_lora.yaml is valid (")
    assert "LlamaDecoderLayer" in result.stdout


def test_a_shipped_recipe_is_found_by_name_from_any_directory(tmp_path):
    for name in ("open_llama_lora", "recipes/open_llama_lora.yaml"):
        result = cli("validate", name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "LlamaDecoderLayer" in result.stdout
    result = cli("show", "tiny_lora_cpu", "train.max_steps=7", cwd=tmp_path)
    assert result.returncode == 0 and yaml.safe_load(result.stdout)["train"]["max_steps"] == 7
    result = cli("validate", "no_such_recipe", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no shipped recipe of that name (shipped: gemma2_9b_lora_v5e8, " in result.stderr
    assert "open_llama_lora, " in result.stderr and "qwen3_8b_lora_v5e8, " in result.stderr


def test_a_second_run_into_the_same_output_dir_is_refused_and_a_killed_ones_lock_is_not(tmp_path):
    """Two notebook cells, two shells: the second run exits 2 naming the holder; a SIGKILLed holder blocks nothing."""
    import signal

    from lowmem_tpu.files import holding

    out = tmp_path / "run"
    hold = f"from pathlib import Path\nfrom lowmem_tpu.files import holding\nwith holding(Path({str(out)!r}), 'x'):\n"
    hold += "    print('held', flush=True)\n    import time; time.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = cli("sft", "recipes/tiny_lora_cpu.yaml", f"output_dir={out}")
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"output_dir: {out} is in use by lowmem-tpu (pid {holder.pid} on" in second.stderr
        assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with holding(out, "output_dir"):  # the kernel dropped the killed holder's lock
        pass


def test_ctrl_c_in_any_long_command_says_interrupted_and_exits_130(tmp_path):
    """Not click's "Aborted!" (exit 1) nor a traceback; sft has its own handling (tests/e2e/test_resume.py)."""
    import signal

    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "lowmem_tpu.cli", "doctor", "--out", str(tmp_path / "doctor.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("training a tiny"):
            proc.send_signal(signal.SIGINT)
            break
    assert proc.wait(timeout=300) == 130
    stderr = proc.stderr.read()
    assert stderr.strip().endswith("interrupted") and "Traceback" not in stderr and "Aborted" not in stderr
