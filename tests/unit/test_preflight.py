"""One validation entry and one preflight: a recipe's validity never depends on the machine, what this
machine must have for a command is asked by ``preflight``; a changed recipe is made by ``with_overrides``."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from lowmem_tpu import preflight as pf
from lowmem_tpu.config import RecipeError, RuntimeSection, load_recipe, with_fields, with_overrides
from lowmem_tpu.errors import UserError
from lowmem_tpu.preflight import as_run_here, preflight
from lowmem_tpu.xla import extras

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_lora_cpu.yaml"
# device auto: the CPU backend here unless PJRT_DEVICE says otherwise; 3 devices do not split a batch of 8.
AUTO3 = ["runtime.device=auto", "runtime.num_cpu_devices=3", "train.global_batch_size=8"]
FLASH = ["model.attn_implementation=flash", "data.max_length=128"]
SPLIT = "train.global_batch_size: the micro-batch (8 / 1 accumulation steps = 8) must split evenly over 3 devices"


def on(monkeypatch, platform: str) -> None:
    monkeypatch.setenv("PJRT_DEVICE", platform)


def test_a_recipe_is_valid_whatever_the_machine(monkeypatch):
    for platform in ("CPU", "TPU"):
        on(monkeypatch, platform)
        assert load_recipe(TINY, [*AUTO3, *FLASH]).runtime.device == "auto"
    # runtime.device: cpu says where it runs: then the CPU backend's limits are the recipe's own problems.
    with pytest.raises(RecipeError, match=re.escape(SPLIT)):
        load_recipe(TINY, ["runtime.device=cpu", "runtime.num_cpu_devices=3", "train.global_batch_size=8"])


def test_the_platform_need_asks_the_cpu_backends_limits_where_auto_lands_on_the_cpu(monkeypatch):
    recipe = load_recipe(TINY, [*AUTO3, *FLASH])
    on(monkeypatch, "TPU")
    assert preflight(recipe, platform=True) is None
    on(monkeypatch, "CPU")
    with pytest.raises(UserError) as info:
        preflight(recipe, platform=True)
    assert [problem[: len(SPLIT)] for problem in info.value.problems] == [SPLIT]
    assert preflight(recipe) is None  # nothing asked, nothing checked


def test_a_tpu_only_setting_runs_its_cpu_equivalent_where_auto_lands_on_the_cpu(monkeypatch):
    recipe = load_recipe(TINY, ["runtime.device=auto", *FLASH])
    on(monkeypatch, "TPU")
    assert as_run_here(recipe) == (recipe, [])
    on(monkeypatch, "CPU")
    here, notes = as_run_here(recipe)
    assert here.model.attn_implementation == "chunked" and len(notes) == 1 and "flash" in notes[0]


def test_the_target_need_asks_the_split_over_the_targets_chips():
    recipe = load_recipe(TINY, ["train.global_batch_size=4", "runtime.target=v5e-8"])  # valid: a run uses its own
    with pytest.raises(UserError, match=r"must split evenly over 8 devices.*\(runtime.target: v5e-8, 8 devices\)"):
        preflight(recipe, target=True)


def test_the_scan_need_names_the_extra(monkeypatch):
    recipe = load_recipe(TINY, ["sharding.scan_layers=true"])

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(extras.importlib.metadata, "version", absent)
    with pytest.raises(UserError, match=r"sharding.scan_layers: needs jax and torchax.*make install-scan"):
        preflight(recipe, scan="installed")
    preflight(load_recipe(TINY), scan="importable")  # no scan_layers: nothing needed


def test_the_reporters_need_names_the_missing_package(monkeypatch):
    recipe = load_recipe(TINY, ["train.report_to=[tensorboard, wandb]"])
    monkeypatch.setattr(pf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError) as info:
        preflight(recipe, reporters=True)
    assert [p.split(" needs")[0] for p in info.value.problems] == [
        "train.report_to: tensorboard",
        "train.report_to: wandb",
    ]


def test_the_room_need_reads_the_disk_of_the_output_dir(tmp_path):
    recipe = load_recipe(TINY, [f"output_dir={tmp_path / 'not' / 'yet'}"])
    preflight(recipe, room=(1, "a byte"))
    with pytest.raises(UserError, match=r"a checkpoint needs .* on the disk of .*not/yet, which has .* free"):
        preflight(recipe, room=(2**70, "a checkpoint"))


def test_with_overrides_validates_the_whole_recipe_and_leaves_the_original_alone():
    recipe = load_recipe(TINY)
    changed = with_overrides(recipe, ["lora.r=4", "train.max_steps=3"])
    assert (changed.lora.r, changed.train.max_steps, recipe.lora.r) == (4, 3, load_recipe(TINY).lora.r)
    assert with_overrides(recipe, []) == recipe.model_copy(update={"extends": None})
    assert with_overrides(recipe.model_dump(mode="json"), ["lora.r=2"]).lora.r == 2  # a run's recipe.yaml
    with pytest.raises(RecipeError) as info:  # a cross-field rule, and a field's, at once
        with_overrides(recipe, ["hub.push=true", "lora.dropout=2"])
    assert [p.split(":")[0] for p in info.value.problems] == ["lora.dropout", "hub.repo_id"]


def test_with_fields_validates_the_section():
    runtime = with_fields(RuntimeSection(), device="cpu", num_cpu_devices=8)
    assert (runtime.device, runtime.num_cpu_devices, runtime.quiet) == ("cpu", 8, True)
    with pytest.raises(ValueError, match="num_cpu_devices"):
        with_fields(runtime, num_cpu_devices=0)


def test_no_copy_skips_validation():
    """pydantic's ``model_copy(update=...)`` validates nothing: a changed recipe or section is made by
    ``config.with_overrides`` or ``config.with_fields``."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "lowmem_tpu").rglob("*.py"))
        if re.search(r"\.model_copy\(\s*update", path.read_text())
    ]
    assert offenders == []
