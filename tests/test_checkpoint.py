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
    from lowmem_tpu.sft import run_sft

    recipe = load_recipe(None, [f"output_dir={tmp_path}", "train.report_to=[tensorboard, wandb]"])
    with pytest.raises(UserError, match=r"train\.report_to: wandb needs the wandb package.*pip install wandb"):
        run_sft(recipe)
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
