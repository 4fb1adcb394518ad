"""Recipes: schema and defaults, extends, overrides, every problem at once, shipped recipes, the reference doc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from lowmem_tpu.config import (
    DataSection,
    LoraSection,
    ModelSection,
    Recipe,
    RecipeError,
    ShardingSection,
    TrainSection,
    apply_overrides,
    load_recipe,
    read_recipe_file,
    validate_recipe,
    with_overrides,
)
from lowmem_tpu.config.assets import BUILTIN, builtin_names
from lowmem_tpu.config.read import default_recipe_path
from lowmem_tpu.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny_lora_cpu.yaml"
CPU4 = ["runtime.device=cpu", "runtime.num_cpu_devices=4"]


def problems_of(overrides: list[str], path: Path | None = TINY) -> list[str]:
    """The problems a recipe with these overrides is refused with."""
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- shipped recipes


def test_recipes_are_shipped():
    assert {p.name for p in RECIPES} >= {"tiny_lora_cpu.yaml", "open_llama_lora.yaml", "open_llama_full.yaml"}
    assert default_recipe_path() == TINY.resolve()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_validates_and_fits_its_model(path):
    from lowmem_tpu.model import check_model

    recipe = load_recipe(path)
    assert recipe.extends is None  # the chain is merged away
    summary = check_model(recipe)
    assert "DecoderLayer" in summary, summary


def test_layer_class_the_model_lacks_is_refused():
    from lowmem_tpu.model import check_model

    recipe = load_recipe(TINY, ["sharding.layer_class=Foo"])  # only the architecture can tell
    with pytest.raises(UserError) as info:
        check_model(recipe)
    [problem] = info.value.problems
    assert problem.startswith("sharding.layer_class: Foo ")
    assert "LlamaDecoderLayer" in problem  # what it could have been


# --------------------------------------------------------------------------- defaults


def test_section_defaults_are_the_memory_saving_ones():
    assert LoraSection().enabled and LoraSection().r == 16
    assert ModelSection(name_or_path="m").dtype == "bfloat16"
    assert ShardingSection().strategy == "fsdp" and ShardingSection().activation_checkpointing
    assert TrainSection().gradient_accumulation_steps == 1
    assert DataSection().path == "builtin:reverse/train.jsonl"


MINIMAL = {
    "model": {"name_or_path": "builtin:tiny-llama", "random_init": True},
    "data": {"path": "builtin:reverse/train.jsonl"},
}


def test_missing_sections_take_their_defaults():
    recipe = validate_recipe({**MINIMAL, "lora": {"r": 4}})
    assert recipe.lora == LoraSection(r=4)
    assert recipe.train == TrainSection()
    assert recipe.data == DataSection(path="builtin:reverse/train.jsonl")
    assert recipe.output_dir == "outputs/run"


def test_empty_recipe_explains_the_default_model_has_no_weights():
    with pytest.raises(RecipeError) as info:
        validate_recipe({})
    [problem] = info.value.problems
    assert problem.startswith("model.random_init: must be true for builtin:tiny-llama")
    assert "no weights" in problem and "default model" in problem


def test_recipes_are_frozen():
    recipe = load_recipe(TINY)
    with pytest.raises(ValueError):
        recipe.lora.r = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- extends


def test_extends_deep_merges_and_the_child_wins(tmp_path):
    (tmp_path / "base").mkdir()
    write(
        tmp_path / "base" / "parent.yaml",
        {"output_dir": "parent", "lora": {"r": 8, "alpha": 16}, "train": {"max_steps": 7, "seed": 1}},
    )
    child = write(tmp_path / "child.yaml", {"extends": "base/parent.yaml", "lora": {"r": 4}, "output_dir": "child"})
    data = read_recipe_file(child)
    assert data == {"output_dir": "child", "lora": {"r": 4, "alpha": 16}, "train": {"max_steps": 7, "seed": 1}}


def test_extends_is_relative_to_the_extending_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the directory of either recipe
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "parent.yaml", {"train": {"max_steps": 3}})
    write(tmp_path / "a" / "child.yaml", {"extends": "parent.yaml"})
    assert read_recipe_file("a/child.yaml") == {"train": {"max_steps": 3}}


def test_extends_names_a_shipped_recipe_from_a_recipe_of_ones_own(tmp_path):
    """A recipe outside the clone extends a shipped one by name; a file beside it of that name wins."""
    mine = write(tmp_path / "mine.yaml", {"extends": "open_llama_lora.yaml", "lora": {"r": 4}})
    recipe = load_recipe(mine)
    assert recipe.lora.r == 4 and recipe.model.name_or_path == "openlm-research/open_llama_3b_v2"
    write(tmp_path / "open_llama_lora.yaml", {"lora": {"alpha": 8}})
    assert read_recipe_file(mine) == {"lora": {"alpha": 8, "r": 4}}
    (tmp_path / "own").mkdir()
    own = write(tmp_path / "own" / "open_llama_lora.yaml", {"extends": "open_llama_lora.yaml", "lora": {"r": 2}})
    assert load_recipe(own).lora.r == 2 and load_recipe(own).lora.alpha == 32  # its own name: the shipped one
    write(tmp_path / "other.yaml", {"extends": "no_such_recipe.yaml"})
    with pytest.raises(RecipeError, match=r"extends: recipe file not found: .*no_such_recipe\.yaml"):
        read_recipe_file(tmp_path / "other.yaml")


def test_shipped_full_recipe_extends_the_lora_one():
    lora, full = load_recipe(ROOT / "recipes/open_llama_lora.yaml"), load_recipe(ROOT / "recipes/open_llama_full.yaml")
    assert not full.lora.enabled and lora.lora.enabled
    # Inherited but for the speed settings, tuned for each (docs/speed.md).
    assert full.model.name_or_path == lora.model.name_or_path and full.data.path == lora.data.path
    assert full.data.packing and full.train.gradient_accumulation_steps == 4
    assert full.train.optimizer == "adafactor" and full.train.max_steps == lora.train.max_steps


def test_extends_cycle_is_named(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(RecipeError) as info:
        read_recipe_file(tmp_path / "a.yaml")
    [problem] = info.value.problems
    assert problem.startswith("extends: cycle: ")
    assert problem.index("a.yaml") < problem.index("b.yaml") < problem.rindex("a.yaml")


def test_extending_itself_is_a_cycle(tmp_path):
    write(tmp_path / "self.yaml", {"extends": "self.yaml"})
    with pytest.raises(RecipeError, match="extends: cycle"):
        read_recipe_file(tmp_path / "self.yaml")


def test_missing_parent_names_both_files(tmp_path):
    child = write(tmp_path / "child.yaml", {"extends": "nowhere.yaml"})
    with pytest.raises(RecipeError) as info:
        read_recipe_file(child)
    [problem] = info.value.problems
    assert problem.startswith("extends: recipe file not found: ")
    assert "nowhere.yaml" in problem and "child.yaml" in problem


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="recipe: recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("lora: [unclosed\n")
    with pytest.raises(RecipeError, match="recipe: not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")
    twice = "model:\n  name_or_path: a/b\ntrain:\n  max_steps: 5\nmodel:\n  dtype: bfloat16\n"
    (tmp_path / "twice.yaml").write_text(twice)
    with pytest.raises(RecipeError, match=r"'model' is given twice \(lines 1 and 5\).*merge the two into one"):
        load_recipe(tmp_path / "twice.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must hold a mapping"):
        load_recipe(tmp_path / "list.yaml")


# --------------------------------------------------------------------------- overrides


def test_override_sets_a_dotted_key():
    recipe = load_recipe(TINY, ["train.max_steps=50"])
    assert recipe.train.max_steps == 50
    assert recipe.train.learning_rate == load_recipe(TINY).train.learning_rate  # the rest untouched


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("50", 50),
        ("3e-4", 3e-4),
        ("2.0e-5", 2e-5),
        ("-1", -1),
        ("0.5", 0.5),
        ("true", True),
        ("false", False),
        ("null", None),
        ("", None),
        ("[a,b]", ["a", "b"]),
        ("[q_proj, v_proj]", ["q_proj", "v_proj"]),
        ("all-linear", "all-linear"),
        ("openlm-research/open_llama_3b_v2", "openlm-research/open_llama_3b_v2"),
        ("a=b", "a=b"),  # only the first = splits
    ],
)
def test_override_values_are_yaml_scalars(raw, value):
    data = apply_overrides({"lora": {"r": 1}}, [f"x.y={raw}"])
    assert data == {"lora": {"r": 1}, "x": {"y": value}}
    assert type(data["x"]["y"]) is type(value)


def test_overrides_reach_typed_fields():
    recipe = load_recipe(
        TINY, ["train.learning_rate=3e-4", "lora.enabled=false", "lora.target_modules=[q_proj,v_proj]"]
    )
    assert recipe.train.learning_rate == 3e-4
    assert recipe.lora.enabled is False
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert load_recipe(TINY, ["data.eval_path=null", "train.eval_samples=0"]).data.eval_path is None


def test_overrides_do_not_change_the_input():
    data = {"lora": {"r": 1}}
    apply_overrides(data, ["lora.r=2"])
    assert data == {"lora": {"r": 1}}


@pytest.mark.parametrize("bad", ["train.max_steps", "=5", "train..max_steps=5", ".r=1"])
def test_malformed_override_shows_the_form(bad):
    with pytest.raises(RecipeError) as info:
        apply_overrides({}, ["lora.r=2", bad])
    assert info.value.problems == [f"{bad}: an override is section.key=value, e.g. train.max_steps=50"]


# --------------------------------------------------------------------------- field problems


def test_unknown_key_suggests_the_close_one():
    [problem] = problems_of(["lora.rr=8"])
    assert problem.startswith("lora.rr: unknown key; did you mean lora.r? (valid: enabled, r, alpha")


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("train.max_length", "data.max_length"), ("max_steps", "train.max_steps"), ("lorra.r", "lora")],
)
def test_unknown_key_in_the_wrong_section_points_to_the_right_one(key, suggestion):
    [problem] = problems_of([f"{key}=4"])
    assert f"did you mean {suggestion}?" in problem


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("lora.r=-1", "lora.r: Input should be greater than 0 (got -1)"),
        ("lora.dropout=1.5", "lora.dropout: Input should be less than 1 (got 1.5)"),
        (
            "train.max_steps=abc",
            "train.max_steps: Input should be a valid integer, unable to parse string as an integer",
        ),
        ("data.max_length=1", "data.max_length: Input should be greater than 1 (got 1)"),
        ("train.optimizer=sgd", "train.optimizer: Input should be 'adamw' or 'adafactor' (got 'sgd')"),
        (
            "lora=true",
            "lora: must be a mapping of lora keys (enabled, r, alpha, dropout, target_modules, dtype, use_rslora, "
            "use_dora, init_lora_weights, loraplus_lr_ratio, modules_to_save) (got True)",
        ),
        ("data.columns=5", "data.columns: must be a mapping (got 5); the format's fields read from other columns"),
        ("lora.target_modules=5", "lora.target_modules: Input should be a valid list or 'all-linear' (got 5)"),
        ("lora.target_modules=[q_proj,3]", "lora.target_modules[1]: Input should be a valid string (got 3)"),
    ],
)
def test_wrong_type_or_range_is_one_clear_line(override, expected):
    [problem] = problems_of([override])
    assert problem.startswith(expected), problem


@pytest.mark.parametrize("value", ["float16", "fp16", "half"])
def test_fp16_is_refused_with_the_bf16_explanation(value):
    [problem] = problems_of([f"model.dtype={value}"])
    assert problem.startswith("model.dtype: fp16 is not a TPU training dtype")
    assert "bfloat16" in problem


def test_missing_local_data_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    [problem] = problems_of([f"data.path={missing}"])
    assert problem == f"data.path: file or directory not found: {missing} (give an existing path or a Hub id)"


def test_local_model_must_be_a_directory(tmp_path):
    file = write(tmp_path / "config.yaml", {})
    [problem] = problems_of([f"model.name_or_path={file}"])
    assert problem.startswith("model.name_or_path: ") and "is a file" in problem


def test_builtin_names_are_files_for_data_and_directories_for_models():
    assert builtin_names("dataset") == [f"reverse/{n}.jsonl" for n in ("eval", "prefer_eval", "prefer_train", "train")]
    assert builtin_names("model") == ["tiny-llama"]


@pytest.mark.parametrize(
    ("override", "listed"),
    [
        ("data.path=builtin:reverse", "built-in ones (files): builtin:reverse/eval.jsonl, builtin:reverse/prefer_eval"),
        ("data.eval_path=builtin:tiny-llama/config.json", "builtin:reverse/eval.jsonl"),
        ("model.name_or_path=builtin:nope", "built-in ones (directories): builtin:tiny-llama"),
        ("model.name_or_path=builtin:reverse/train.jsonl", "builtin:tiny-llama"),
        ("model.tokenizer=builtin:../recipe.py", "builtin:tiny-llama"),
    ],
)
def test_unknown_builtin_lists_the_usable_ones(override, listed):
    key, _, value = override.partition("=")
    [problem] = problems_of([override])
    assert problem.startswith(f"{key}: no built-in ")
    assert repr(value) in problem and listed in problem


def test_builtin_model_needs_random_init():
    [problem] = problems_of(["model.name_or_path=builtin:tiny-llama", "model.random_init=false"])
    assert problem.startswith("model.random_init: must be true for builtin:tiny-llama")
    assert "no weights" in problem


# --------------------------------------------------------------------------- cross-field problems


def test_global_batch_must_split_over_cpu_devices_and_accumulation():
    [problem] = problems_of(["train.global_batch_size=6", *CPU4])
    assert problem == (
        "train.global_batch_size: the micro-batch (6 / 1 accumulation steps = 6) must split evenly over "
        "4 devices; use a multiple of 4"
    )
    [problem] = problems_of(["train.global_batch_size=12", "train.gradient_accumulation_steps=2", *CPU4])
    assert problem.endswith("(12 / 2 accumulation steps = 6) must split evenly over 4 devices; use a multiple of 8")
    assert load_recipe(TINY, ["train.global_batch_size=16", "train.gradient_accumulation_steps=2", *CPU4])


def test_global_batch_not_divisible_by_accumulation():
    found = problems_of(["train.global_batch_size=10", "train.gradient_accumulation_steps=4"])
    assert found[0] == "train.global_batch_size: 10 is not divisible by train.gradient_accumulation_steps (4)"


def test_hub_push_needs_a_repo_id():
    assert problems_of(["hub.push=true"]) == ["hub.repo_id: required when hub.push is true (OWNER/NAME)"]
    assert load_recipe(TINY, ["hub.push=true", "hub.repo_id=me/tiny"]).hub.repo_id == "me/tiny"


def test_eval_samples_and_steps_need_an_eval_path():
    found = problems_of(["data.eval_path=null", "train.eval_samples=3", "train.eval_steps=5"])
    assert found == [
        "train.eval_samples: needs data.eval_path or data.eval_fraction (held-out prompts to score)",
        "train.eval_steps: needs data.eval_path or data.eval_fraction (without one nothing is evaluated)",
    ]


def test_every_problem_is_reported_at_once():
    found = problems_of(["lora.rr=8", "lora.dropout=1.5", "train.global_batch_size=6", "hub.push=true", *CPU4])
    assert [p.split(":")[0] for p in found] == ["lora.dropout", "lora.rr", "train.global_batch_size", "hub.repo_id"]
    assert found[1].startswith("lora.rr: unknown key; did you mean lora.r?")


def test_a_bad_field_does_not_cause_a_spurious_cross_check():
    # The rejected value is replaced by its default for the second pass: a default batch of 8
    # does not split over 3 devices, and the default model needs random_init, but neither is
    # the user's mistake.
    overrides = ["train.global_batch_size=abc", "runtime.device=cpu", "runtime.num_cpu_devices=3"]
    found = problems_of([*overrides, "model.name_or_path=builtin:x", "model.random_init=false"])
    assert [p.split(":")[0] for p in found] == ["model.name_or_path", "train.global_batch_size"]


def test_cross_checks_also_guard_direct_construction():
    with pytest.raises(ValueError, match=r"hub\.repo_id: required"):
        Recipe.model_validate({"model": {"random_init": True}, "hub": {"push": True}})


# --------------------------------------------------------------------------- to_yaml and the reference


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_to_yaml_round_trips_without_extends(path, tmp_path):
    recipe = load_recipe(path)
    text = recipe.to_yaml()
    assert "extends" not in text
    dumped = yaml.safe_load(text)
    assert set(dumped) == set(Recipe.model_fields) - {"extends"}  # every section spelled out
    assert validate_recipe(dumped) == recipe
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def test_every_field_has_a_one_line_description():
    sections = [f.annotation for f in Recipe.model_fields.values() if _is_section(f.annotation)]
    assert len(sections) == 8
    for model in [Recipe, *sections]:
        assert model.__doc__, model.__name__  # a section's docstring describes it
        for name, field in model.model_fields.items():
            if field.annotation not in sections:
                assert field.description and "\n" not in field.description, f"{model.__name__}.{name}"


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python tools/NAME.py ARGS`` (a tool imports the installed package only), run from the repository."""
    command = [sys.executable, str(ROOT / "tools" / f"{name}.py"), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_reference_doc_is_generated_from_the_schema():
    done = _tool("recipe_reference", "--check")
    assert done.returncode == 0, done.stderr[-3000:]
    text = (ROOT / "docs" / "recipes.md").read_text()
    for name in ("lora.r", "train.global_batch_size", "hub.repo_id", "output_dir"):
        assert f"| `{name}` |" in text
    assert "| `lora.r` | `0 < int <= 4096` | `16` |" in text
    assert "| `model.dtype` | `bfloat16 \\| float32` | `bfloat16` |" in text
    assert f"`{BUILTIN}reverse/train.jsonl`" in text


def test_data_splits_and_templates_are_checked():
    found = problems_of(["data.subset=en", "data.eval_fraction=0.1", "data.eval_path=builtin:reverse/eval.jsonl"])
    assert any(p.startswith("data.subset: builtin:reverse/train.jsonl is a file") for p in found)
    assert any(p.startswith("data.eval_fraction: held-out data is data.eval_path or a fraction") for p in found)
    found = problems_of(["data.chat_template=nope"])
    assert found == [
        "data.chat_template: 'nope' is neither a shipped template (chatml, plain) nor a Jinja file that exists"
    ]


@pytest.mark.parametrize(
    ("length", "names"),
    [(768, ("512", "1024")), (2000, ("1024", "2048")), (384, ("256", "512")), (200, ("128", "256")), (24, ("128",))],
)
def test_flash_refuses_a_length_its_backward_cannot_tile_naming_the_ones_that_work(length, names):
    from lowmem_tpu.config.checks import flash_tiles

    with pytest.raises(UserError) as err:
        load_recipe(None, ["runtime.device=tpu", "model.attn_implementation=flash", f"data.max_length={length}"])
    message = next(p for p in err.value.problems if p.startswith("data.max_length"))
    assert f"{length} cannot be tiled" in message and all(f" {n}" in message for n in names) and "chunked" in message
    # torch_xla 2.9's backward blocks: min(1024, L), min(512, L), min(256, L) must each divide L, in 128s
    # (what the kernel's trace for a TPU says: tests/e2e/test_tpu_only_paths.py).
    assert [n for n in (100, 128, 200, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096) if flash_tiles(n)] == [
        128,
        256,
        512,
        1024,
        2048,
        3072,
        4096,
    ]
    load_recipe(None, ["runtime.device=tpu", "model.attn_implementation=flash", "data.max_length=1024"])


def test_the_embedded_default_assets_are_what_their_tool_builds():
    """lowmem_tpu/assets' tiny Llama (config, tokenizer) and reverse data, byte for byte: tools/make_tiny_assets.py."""
    done = _tool("make_tiny_assets", "--check")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_starting_adapters_lora_settings_replace_the_recipes(tmp_path):
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    saved = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "use_rslora": True}
    (adapter / "adapter_config.json").write_text(json.dumps(saved | {"target_modules": ["v_proj", "q_proj"]}))
    recipe = load_recipe(default_recipe_path(), [f"model.adapter={adapter}", "lora.r=64"])
    assert (recipe.lora.r, recipe.lora.alpha, recipe.lora.dropout) == (4, 8, 0.1)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"] and recipe.lora.use_rslora
    hub = load_recipe(default_recipe_path(), ["model.adapter=someone/adapter", "lora.r=64"])
    assert hub.lora.r == 64  # not a local directory: read when it loads
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(RecipeError, match="is not readable JSON"):
        load_recipe(default_recipe_path(), [f"model.adapter={adapter}"])


def test_a_key_recipes_no_longer_have_names_what_replaces_it():
    """At its old default (what every run's saved recipe.yaml spells out) it is dropped; any other value is told
    what replaces it."""
    old = load_recipe(TINY).model_dump(mode="json")
    old["data"] |= {"text_field": "text", "messages_field": "messages"}
    old["sharding"]["offload_activations"] = False
    assert with_overrides(old, []) == load_recipe(TINY).model_copy(update={"extends": None})
    found = problems_of(["data.text_field=body", "sharding.offload_activations=true"])
    assert found == [
        "data.text_field: no longer a recipe key: name the column with data.columns: {text: COLUMN}",
        "sharding.offload_activations: no longer a recipe key: host offload saved no HBM per the TPU compiler; "
        "remove it (docs/memory.md lists the levers that do)",
    ]
