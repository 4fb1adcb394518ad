"""``lowmem-tpu tune``'s search space and the recipe it writes (no compile: tests/e2e/test_tune.py compiles)."""

from __future__ import annotations

from pathlib import Path

import yaml

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.measure.tune import Candidate, Tried, best, candidates, flash_allowed, tuned_yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "open_llama_lora.yaml"
# The recipe's settings before it was tuned: what the search starts from in these tests.
BEFORE = [
    "model.attn_implementation=eager",
    "data.packing=false",
    "sharding.activation_checkpointing=true",
    "train.gradient_accumulation_steps=1",
]


def test_the_recipe_is_tried_first_then_less_recomputation_and_fewer_rows_and_the_global_batch_is_kept():
    recipe = load_recipe(str(RECIPE), ["runtime.device=tpu", *BEFORE])
    found = candidates(recipe, DEVICES["v5e-8"], {False: 0.5, True: 0.8}, grow_batch=False)
    own = found[0]
    assert (own.rows, own.accumulation, own.checkpointing, own.attention, own.packing) == (4, 1, True, "eager", False)
    assert len(found) == len(set(found))  # each setting once
    assert {c.rows * c.accumulation for c in found} == {4}  # 32 sequences over 8 chips, always
    assert {c.checkpointing for c in found} == {True, False, "every_2", "every_4"}
    assert {c.attention for c in found} == {"eager", "flash"} and {c.packing for c in found} == {False, True}
    assert found[1].checkpointing is False and found[1].rows == 1  # the least recomputation, fewest rows next
    assert [c.rows for c in found[1:4]] == [1, 2, 4]
    grown = candidates(recipe, DEVICES["v5e-8"], {False: 0.5, True: 0.8}, grow_batch=True)  # 4 rows now: 8, 16
    assert {c.rows for c in grown} == {1, 2, 4, 8, 16}


def test_no_packing_without_a_fuller_fill_and_no_flash_off_a_tpu_or_where_it_cannot_tile():
    recipe = load_recipe(str(RECIPE), ["runtime.device=tpu", *BEFORE])
    unknown = candidates(recipe, DEVICES["v5e-8"], {False: None, True: None}, grow_batch=False)
    assert {c.packing for c in unknown} == {False}
    short = load_recipe(str(RECIPE), ["runtime.device=tpu", *BEFORE, "data.max_length=600"])
    assert {c.attention for c in candidates(short, DEVICES["v5e-8"], {}, grow_batch=False)} == {"eager"}


def test_no_flash_where_the_model_windows_or_caps_its_attention():
    """Gemma 2's scores are soft-capped: flash would compute another model, so tune never offers it."""
    gemma2 = load_recipe(str(RECIPE.parent / "gemma2_9b_lora_v5e8.yaml"))
    assert not flash_allowed(gemma2)
    assert {c.attention for c in candidates(gemma2, DEVICES["v5e-8"], {}, False, flash=False)} == {"eager"}
    assert flash_allowed(load_recipe(str(RECIPE)))


def test_the_tuned_recipe_extends_the_original_and_sets_only_what_changed(tmp_path):
    recipe = load_recipe(str(RECIPE), ["runtime.device=tpu"])
    device = DEVICES["v5e-8"]
    estimate = {"reported": True, "step_seconds": 0.8, "mfu": 0.4, "tokens_per_second_per_chip": 5000.0}
    baseline = Tried(Candidate(4, 1, True, "eager", False), needed=2**31, fits=True, estimate=estimate)
    chosen = Tried(Candidate(2, 2, "every_2", "flash", False), needed=2**32, fits=True, estimate=estimate)
    assert best([baseline, chosen, Tried(Candidate(4, 1, False, "flash", False))]) in (baseline, chosen)
    out = tmp_path / "sub" / "tuned.yaml"
    out.parent.mkdir()
    text = tuned_yaml(RECIPE, out, recipe, device, chosen, baseline)
    data = yaml.safe_load(text)
    assert data["extends"] == "open_llama_lora.yaml"  # shipped: by name, found wherever the package is
    assert "runtime" not in data  # tuned for the recipe's own target
    same_name = tmp_path / "open_llama_lora.yaml"  # --out named as the shipped recipe: by its path, no cycle
    named = yaml.safe_load(tuned_yaml(RECIPE, same_name, recipe, device, chosen, baseline))["extends"]
    assert named != "open_llama_lora.yaml" and (tmp_path / named).resolve() == RECIPE.resolve()
    assert data["train"] == {"gradient_accumulation_steps": 2}  # 2 rows x 8 chips x 2 = 32: the batch is unchanged
    assert data["sharding"] == {"activation_checkpointing": "every_2"} and data["model"] == {
        "attn_implementation": "flash"
    }
    assert "data" not in data and "chosen:" in text and "original:" in text
    out.write_text(text)
    tuned = load_recipe(str(out), ["runtime.device=tpu"])
    assert tuned.train.global_batch_size == 32 and tuned.sharding.checkpoint_every == 2


def test_the_tuned_recipe_keeps_the_overrides_tune_was_given(tmp_path):
    """Every candidate was compiled with them: the written recipe sets them, a knob tune changed after them."""
    given = ["lora.dtype=model", "model.attn_implementation=eager", "data.max_length=512", "runtime.device=tpu"]
    recipe = load_recipe(str(RECIPE), given)
    estimate = {"reported": True, "step_seconds": 0.8, "mfu": 0.4, "tokens_per_second_per_chip": 5000.0}
    baseline = Tried(Candidate(2, 2, False, "eager", True), needed=2**31, fits=True, estimate=estimate)
    chosen = Tried(Candidate(2, 2, False, "flash", True), needed=2**31, fits=True, estimate=estimate)
    out = tmp_path / "tuned.yaml"
    out.write_text(tuned_yaml(RECIPE, out, recipe, DEVICES["v5e-8"], chosen, baseline, given))
    assert "#   given:    lora.dtype=model model.attn_implementation=eager data.max_length=512" in out.read_text()
    tuned = load_recipe(str(out))
    assert tuned.lora.dtype == "model" and tuned.data.max_length == 512
    assert tuned.model.attn_implementation == "flash"
    assert tuned.runtime.device == load_recipe(str(RECIPE)).runtime.device  # where tune compiled is not kept


def test_a_recipe_tuned_for_another_target_names_it_and_a_recipe_of_ones_own_is_extended_by_its_path(tmp_path):
    """``--target v5e-1`` for a v5e-8 recipe: its figures are for v5e-1, so is the recipe it writes; a recipe
    that is not shipped is named by its path relative to the tuned one."""
    mine = tmp_path / "mine" / "lora.yaml"
    mine.parent.mkdir()
    mine.write_text("extends: open_llama_lora.yaml\nlora:\n  r: 8\n")
    recipe = load_recipe(str(mine), ["runtime.device=tpu"])
    estimate = {"reported": True, "step_seconds": 0.8, "mfu": 0.4, "tokens_per_second_per_chip": 5000.0}
    baseline = Tried(Candidate(32, 1, False, "flash", True), needed=2**33, fits=False, estimate=estimate)
    chosen = Tried(Candidate(4, 8, False, "flash", True), needed=2**33, fits=True, estimate=estimate)
    out = tmp_path / "tuned" / "lora_v5e1.yaml"
    out.parent.mkdir()
    out.write_text(tuned_yaml(mine, out, recipe, DEVICES["v5e-1"], chosen, baseline))
    assert yaml.safe_load(out.read_text())["extends"] == "../mine/lora.yaml"
    tuned = load_recipe(str(out))
    assert tuned.runtime.target == "v5e-1" and tuned.lora.r == 8
    assert tuned.train.global_batch_size == 32 and tuned.train.gradient_accumulation_steps == 8


def test_knobs_held_stay_as_the_recipe_has_them():
    recipe = load_recipe(str(RECIPE), ["runtime.device=tpu", *BEFORE])
    held = candidates(recipe, DEVICES["v5e-8"], {False: 0.5, True: 0.8}, False, keep=("checkpointing", "packing"))
    assert {c.checkpointing for c in held} == {True} and {c.packing for c in held} == {False}
    assert {c.attention for c in held} == {"eager", "flash"} and {c.rows for c in held} == {1, 2, 4}
    assert {c.placement for c in held} == {"fsdp", "replicated"}  # where the weights live is searched too
    kept = ("placement", "rows", "checkpointing", "attention")
    assert candidates(recipe, DEVICES["v5e-8"], {}, False, keep=kept) == held[:1]
    one_chip = {c.placement for c in candidates(recipe, DEVICES["v5e-1"], {}, False)}
    assert one_chip == {recipe.sharding.strategy}  # one chip: no choice, the recipe's kept


def test_a_setting_holding_at_least_what_did_not_fit_is_not_compiled():
    """More rows, or fewer layers recomputed, than a setting over the chip (same packing; same attention, or
    eager where it had flash) is over too."""
    over = Candidate(2, 2, "every_4", "flash", True)
    assert Candidate(4, 2, "every_4", "flash", True).needs_at_least(over)
    assert Candidate(2, 2, False, "flash", True).needs_at_least(over)
    assert over.needs_at_least(over)
    assert not Candidate(1, 4, False, "flash", True).needs_at_least(over)  # fewer rows: may fit
    assert not Candidate(4, 1, "every_2", "flash", True).needs_at_least(over)  # more recomputed: may fit
    assert Candidate(2, 2, "every_4", "eager", True).needs_at_least(over)  # eager keeps the scores flash does not
    assert not over.needs_at_least(Candidate(2, 2, "every_4", "eager", True))  # flash may fit where eager did not
    assert not Candidate(2, 2, "every_4", "chunked", True).needs_at_least(over)  # another kernel: another program
    assert not Candidate(2, 2, "every_4", "flash", False).needs_at_least(over)
    assert not Candidate(4, 1, "every_4", "flash", True).needs_at_least(Candidate(1, 4, "every_4", "flash", True))
    replicated = Candidate(2, 2, "every_4", "flash", True, placement="replicated")
    assert replicated.needs_at_least(over) and not over.needs_at_least(replicated)  # a whole copy on each chip


def test_a_preference_recipe_counts_pairs():
    """DPO's global batch counts pairs, each a chosen and a rejected row: tune says pairs, and keeps the batch."""
    dpo = load_recipe(str(RECIPE.parent / "llama3_3b_dpo_v5e1.yaml"), ["runtime.device=tpu"])
    found = candidates(dpo, DEVICES["v5e-1"], {}, grow_batch=False)
    assert {c.unit for c in found} == {"pairs"} and {c.rows * c.accumulation for c in found} == {8}
    assert {c.packing for c in found} == {False}  # pairs are never packed
    assert Candidate(1, 8, False, "flash", False, "pairs").describe().startswith("1 pair/chip x 8 accumulated")
