"""Checkpoints between logs: one graph cut and one batched host copy, nothing compiled again, a watched run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import train_tiny

pytestmark = pytest.mark.slow

# Saves at 4, 8, 12 and 16 fall on steps that log nothing (logs at 5, 10, 15): the case that used to
# copy every tensor before the step's graph was cut, recompiling the step for each one.
SAVING = [
    "train.max_steps=16",
    "train.logging_steps=5",
    "train.save_steps=4",
    "train.keep_last=2",
    "train.global_batch_size=16",
    "train.eval_samples=0",
    "data.eval_path=null",
]


@pytest.fixture(scope="module")
def saving_run(tmp_path_factory):
    return train_tiny(tmp_path_factory, "saving", *SAVING)


def test_saves_between_logs_complete_and_compile_nothing_after_the_first(saving_run):
    recipe, run = saving_run
    out = Path(recipe.output_dir)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-12", "step-16"]
    assert all((out / "checkpoints" / name / "COMPLETE").exists() for name in ("step-12", "step-16"))
    compiles = run.metrics["compiles"]
    assert list(compiles["at_saves"]) == ["4", "8", "12", "16"]
    assert all(count == 0 for count in list(compiles["at_saves"].values())[1:]), compiles["at_saves"]
    assert compiles["after_warmup"] == 0, compiles


def test_final_records_its_files_and_a_changed_adapter_is_refused_by_what_loads_it(saving_run, tmp_path):
    import shutil

    from lowmem_tpu.errors import UserError
    from lowmem_tpu.infer.load import kind_of

    _, run = saving_run
    manifest = json.loads((run.final_dir / "MANIFEST.json").read_text())["files"]
    assert manifest["adapter_model.safetensors"]["sha256"] and "tokenizer.json" in manifest
    copy = shutil.copytree(run.final_dir, tmp_path / "copy")
    assert kind_of(copy) == "adapter"
    weights = bytearray((copy / "adapter_model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # one flipped byte, same size
    (copy / "adapter_model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(UserError, match=r"is damaged: adapter_model\.safetensors does not hold what was written"):
        kind_of(copy)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    (copy / "adapter_model.safetensors").write_bytes((run.final_dir / "adapter_model.safetensors").read_bytes())
    assert kind_of(copy) == "adapter"  # configs and tokenizer files are the user's to edit


def test_every_log_is_a_json_line_as_it_happens(saving_run):
    recipe, run = saving_run
    lines = [json.loads(line) for line in (Path(recipe.output_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [entry for entry in lines if "loss" in entry]
    assert [entry["step"] for entry in train] == [5, 10, 15]
    for entry in train:
        assert {"loss", "learning_rate", "grad_norm", "time"} <= set(entry)
        # memory per device: the plan always; measured figures only where the backend keeps them (not the CPU)
        planned = run.metrics["memory"]["per_device_bytes"]["planned_peak"]
        assert planned > 0 and entry["memory_planned_gib"] == pytest.approx(planned / 2**30)
        assert "memory_peak_gib" not in entry and "memory_per_device" not in entry
    assert all(key in train[-1] for key in ("tokens_per_second", "step_time"))
    assert [e["loss"] for e in train] == [e["loss"] for e in run.metrics["train"]["losses"]]


def test_the_model_card_shows_the_memory_the_run_recorded(saving_run):
    from lowmem_tpu.publish.card import model_card

    recipe, _ = saving_run
    final = Path(recipe.output_dir) / "final"
    memory = json.loads((final / "metrics.json").read_text())["memory"]
    planned = memory["per_device_bytes"]["planned_peak"]
    assert 0 < planned < memory["per_device_bytes"]["device_memory"] and memory["planned_by"].endswith("cpu layout")
    text = model_card(final, "alice/x", "adapter")
    assert f"| planned peak per device | {planned / 2**20:.1f} MiB (" in text
    assert "not measured: the CPU backend keeps no allocator statistics" in text and "not recorded" not in text


def test_a_missing_reporting_integration_is_refused_before_loading(tmp_path):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.errors import UserError
    from lowmem_tpu.run import run_training

    recipe = load_recipe(None, [f"output_dir={tmp_path}", "train.report_to=[tensorboard, wandb]"])
    with pytest.raises(UserError, match=r"train\.report_to: wandb needs the wandb package.*pip install wandb"):
        run_training(recipe)
    assert not (tmp_path / "final").exists()


def test_tensorboard_receives_the_logs(tmp_path_factory):
    recipe, _ = train_tiny(
        tmp_path_factory,
        "tensorboard",
        "train.max_steps=4",
        "train.logging_steps=2",
        "train.global_batch_size=16",
        "train.eval_samples=0",
        "data.eval_path=null",
        "train.report_to=tensorboard",
    )
    events = list((Path(recipe.output_dir) / "runs").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def _probe(checkpoint: Path, out: Path, devices: int, *overrides: str) -> Path:
    """Restore ``checkpoint`` on ``devices`` CPU devices and save it again (tests/helpers/reshard_probe.py)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"} | {"CPU_NUM_DEVICES": str(devices)}
    probe = Path(__file__).resolve().parents[1] / "helpers" / "reshard_probe.py"
    cmd = [sys.executable, str(probe), str(checkpoint), str(out), f"runtime.num_cpu_devices={devices}", *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=probe.parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"saved on {devices} devices" in done.stdout
    return out / "checkpoints" / checkpoint.name


def _same_state(a: Path, b: Path) -> None:
    import torch

    from lowmem_tpu.train import checkpoint as ckpt

    left, right = ckpt.read_whole(a), ckpt.read_whole(b)
    assert sorted(left) == sorted(right)
    for key, value in left.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == right[key].dtype and torch.equal(value, right[key]), key
        else:
            assert value == right[key], key


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        ("lora.dropout=0.0",),
        ("lora.enabled=false", "model.dtype=bfloat16"),  # full fine-tuning with fp32 master weights
    ],
    ids=["lora", "full-bf16-masters"],
)
def test_a_checkpoint_exports_as_final_and_restores_on_8_devices_and_back_bit_for_bit(tmp_path, mode):
    """A checkpoint's export equals final/ (adapter or model); sharded state (DCP with torch_xla's SPMD planners)
    saved on 4 devices restores on 8 and back, each device count reading only its own regions."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.run import run_training
    from lowmem_tpu.train import checkpoint as ckpt

    overrides = ("train.max_steps=2", "train.save_steps=2", "train.eval_samples=0", "data.eval_path=null", *mode)
    run_training(load_recipe("recipes/tiny_lora_cpu.yaml", [f"output_dir={tmp_path / 'on4'}", *overrides]))
    saved = tmp_path / "on4" / "checkpoints" / "step-2"
    kinds = {key.split("/")[0] for key in ckpt.read_metadata(saved)}
    assert kinds == (
        {"trainable", "optimizer", "master"} if "lora.enabled=false" in mode else {"trainable", "optimizer"}
    )
    _exports_as_final(saved, tmp_path / "on4" / "final", tmp_path / "exported")
    if "lora.enabled=false" not in mode:
        return  # resharding reads state alike for any mode: the full step's (weights, masters, AdamW) holds most
    on8 = _probe(saved, tmp_path / "on8", 8, *overrides)
    _same_state(saved, on8)
    back = _probe(on8, tmp_path / "back4", 4, *overrides)
    _same_state(saved, back)


def _exports_as_final(checkpoint: Path, final: Path, out: Path) -> None:
    """``lowmem-tpu export`` of the last checkpoint writes what final/ holds; plain transformers/PEFT load it."""
    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from lowmem_tpu.cli import app

    done = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(out)])
    assert done.exit_code == 0, done.output
    weights = "adapter_model.safetensors" if (final / "adapter_config.json").exists() else "model.safetensors"
    a, b = load_file(str(final / weights)), load_file(str(out / weights))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM

    if weights == "model.safetensors":
        AutoModelForCausalLM.from_pretrained(out)
    else:
        from peft import PeftModel

        config = json.loads((out / "adapter_config.json").read_text())
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), out)
