"""The real command line in a subprocess: exit codes, messages without tracebacks, nothing heavy loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torch_xla", "transformers", "trl", "peft", "datasets")


def cli(*args: str, importtime: bool = False, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
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


def imported(stderr: str) -> set[str]:
    """Top-level packages named in ``-X importtime`` lines."""
    lines = (line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:"))
    return {name.split(".")[0] for name in lines}


def errors(stderr: str) -> str:
    """stderr without the ``-X importtime`` lines."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


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


def test_misspelt_key_exits_2_with_the_suggestion_and_no_traceback():
    result = cli("validate", "recipes/tiny_lora_cpu.yaml", "lora.rr=8", importtime=True)
    assert result.returncode == 2
    message = errors(result.stderr)
    assert message.startswith("error: lora.rr: unknown key; did you mean lora.r?")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not imported(result.stderr) & set(HEAVY)


def test_every_problem_is_printed_at_once():
    result = cli("validate", "recipes/tiny_lora_cpu.yaml", "lora.rr=8", "lora.dropout=1.5", "train.global_batch_size=6")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "error: invalid input:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["lora.dropout", "lora.rr", "train.global_batch_size"]
    assert "Traceback" not in result.stderr


def test_missing_recipe_file_exits_2():
    result = cli("validate", "recipes/nope.yaml")
    assert result.returncode == 2
    assert result.stderr == "error: recipe: recipe file not found: recipes/nope.yaml\n"


def test_show_applies_overrides_and_the_parents_values():
    result = cli("show", "recipes/open_llama_full.yaml", "train.max_steps=7", "lora.r=4")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert "extends" not in shown
    assert shown["train"]["max_steps"] == 7 and shown["lora"]["r"] == 4  # overrides
    assert shown["lora"]["enabled"] is False and shown["train"]["optimizer"] == "adafactor"  # the child
    assert shown["model"]["name_or_path"] == "openlm-research/open_llama_3b_v2"  # the parent
    assert shown["data"]["format"] == "alpaca"
    assert shown["sharding"]["activation_checkpointing"] is True  # every value spelled out


def test_show_without_a_recipe_prints_the_embedded_default():
    result = cli("show")
    assert result.returncode == 0, result.stderr
    embedded = yaml.safe_load((ROOT / "recipes" / "tiny_lora_cpu.yaml").read_text())
    shown = yaml.safe_load(result.stdout)
    assert shown["output_dir"] == embedded["output_dir"]
    assert shown["model"]["name_or_path"] == "builtin:tiny-llama" and shown["model"]["random_init"] is True
    assert shown["runtime"] == {**shown["runtime"], **embedded["runtime"]}


def test_show_takes_overrides_without_a_recipe():
    result = cli("show", "train.max_steps=3")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["train"]["max_steps"] == 3


@pytest.mark.parametrize("command", ["validate", "show", "sft"])
def test_help_lists_the_overrides(command):
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Overrides as section.key=value, e.g. train.max_steps=50" in text
    assert "Recipe YAML (default: the embedded tiny CPU demo)" in text


def test_sft_with_a_bad_recipe_exits_before_loading_anything(tmp_path):
    out = tmp_path / "run"
    result = cli("sft", "recipes/tiny_lora_cpu.yaml", f"output_dir={out}", "lora.r=-1", importtime=True)
    assert result.returncode == 2
    assert errors(result.stderr) == "error: lora.r: Input should be greater than 0 (got -1)"
    assert not imported(result.stderr) & set(HEAVY)
    assert not out.exists()


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
    """Not click's "Aborted!" (exit 1) nor a traceback; sft has its own handling (tests/test_resume.py)."""
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
