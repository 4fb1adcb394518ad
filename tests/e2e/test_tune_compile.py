"""``lowmem-tpu tune``: the fastest settings that fit, each compiled by the TPU compiler on this machine.

The tiny demo with 16 sequences on Kaggle's v5e-8 and its checkpointing held leaves where the weights live
(sharded or a copy on each chip) and the micro-batch to search (2 rows per chip, or 1 in each of 2
micro-batches): four compiles of seconds each. A recipe that fits nowhere writes nothing.
"""

from __future__ import annotations

import json

import yaml
from cli_runs import command_cli, compiler_cli
from markers import needs_compiler

pytestmark = needs_compiler


def test_tune_writes_the_fastest_fitting_recipe_which_validate_accepts(tmp_path):
    out = tmp_path / "tuned.yaml"
    # 16 sequences on 8 chips, 1 row in each of 2 micro-batches held (test_tune orders the rows searched), the
    # weights sharded or replicated.
    args = ["recipes/tiny_lora_cpu.yaml", "train.global_batch_size=16", "train.gradient_accumulation_steps=2"]
    args += ["--target", "v5e-8", "--keep", "checkpointing,rows"]
    done = compiler_cli("tune", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[2/2]" in done.stderr and "fastest that fits" in done.stdout
    report = json.loads(out.with_suffix(".json").read_text())
    tried = report["tried"]
    assert [(t["settings"]["placement"], t["settings"]["rows"], t["settings"]["accumulation"]) for t in tried] == [
        ("fsdp", 1, 2),  # the recipe's first
        ("replicated", 1, 2),
    ]
    assert all(t["held"] > t["needed"] for t in tried)  # its generated code is held beside its buffers
    assert all(t["fits"] and t["estimate"]["reported"] for t in tried)
    assert {t["settings"]["checkpointing"] for t in tried} == {True}  # held
    assert report["fill"]["padded"] > 0.5  # the demo's own data, tokenized: every row nearly full
    fastest = max(tried, key=lambda t: t["estimate"]["useful_tokens_per_second_per_chip"])
    text = out.read_text()
    recipe = yaml.safe_load(text)
    assert recipe["extends"] == "tiny_lora_cpu.yaml"  # shipped: by name
    assert recipe["runtime"] == {"target": "v5e-8"}  # tuned for v5e-8, not the demo's CPU target
    accumulation = fastest["settings"]["accumulation"]
    assert recipe.get("train", {}).get("gradient_accumulation_steps", 1) == accumulation  # only what changed
    assert recipe.get("sharding", {}).get("strategy", "fsdp") == fastest["settings"]["placement"]
    assert recipe["train"]["global_batch_size"] == 16 and report["overrides"] == args[1:3]
    assert "tuned for v5e-8" in text and "original:" in text
    valid = command_cli("validate", str(out), "runtime.device=cpu")
    assert valid.returncode == 0, valid.stderr[-2000:]
    held = compiler_cli("tune", *args[:-1], "speed", "--out", str(tmp_path / "x.yaml"))
    assert held.returncode == 2 and "--keep: unknown speed" in held.stderr and "Traceback" not in held.stderr


def test_tune_on_a_recipe_that_fits_nowhere_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "tuned.yaml"
    done = compiler_cli("tune", "recipes/open_llama_full.yaml", "--target", "v5e-1", "--out", str(out))
    assert done.returncode == 1 and "nothing fits v5e-1" in done.stdout, done.stderr[-2000:]
    assert not out.exists() and "skipped: the planner puts it far over" in done.stderr
