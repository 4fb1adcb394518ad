"""The real command line in a subprocess: exit codes, messages without tracebacks, nothing heavy loaded
(the ones that take seconds: e2e/test_cli_heavy.py)."""

from __future__ import annotations

import pytest
import yaml
from cli_runs import ROOT
from cli_runs import command_cli as cli

HEAVY = ("torch", "torch_xla", "transformers", "trl", "peft", "datasets")


def imported(stderr: str) -> set[str]:
    """Top-level packages named in ``-X importtime`` lines."""
    lines = (line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:"))
    return {name.split(".")[0] for name in lines}


def errors(stderr: str) -> str:
    """stderr without the ``-X importtime`` lines."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


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
    assert shown["sharding"]["activation_checkpointing"] is False  # every value spelled out


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
