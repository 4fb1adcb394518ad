"""The planner's TPU layout against the TPU compiler (libtpu's compile-only client), over a grid of levers.

    .venv/bin/python scripts/tpu_planner_grid.py [--models tiny,mini] [--devices v5e-8,v5e-1] [--only NAME ...]
                                                [--json docs/tpu_planner_grid.json]

Each point is ``recipes/tiny_lora_cpu.yaml`` with overrides, its steady step traced with placeholders
and compiled for the device (``lowmem-tpu memory --compile``), beside the planner's peak for the same
recipe and device. ``mini`` has Open Llama 3B's proportions (head size 100, MLP 2.7 x hidden, vocabulary
32,000) at 4 layers of hidden 400. The real 3B shape is the shipped recipes (scripts/tpu_compile_recipes.py).
Prints a markdown table and the worst point; ``--json`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from memory_levers import MINI  # Open Llama 3B's proportions at 4 layers of hidden 400 (scripts/ is on the path)

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.errors import UserError
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.memory.tpu_compile import compile_recipe

ROOT = Path(__file__).resolve().parents[1]
# Every point trains bf16 weights as a TPU run does (the tiny recipe is fp32 for the CPU backend).
COMMON = ["model.dtype=bfloat16", "train.eval_samples=0", "data.eval_path=null", "train.eval_steps=null"]
POINTS = {
    "lora, checkpointing": [],
    "lora, no checkpointing": ["sharding.activation_checkpointing=false"],
    "lora, every_2": ["sharding.activation_checkpointing=every_2"],
    "full, checkpointing": ["lora.enabled=false"],
    "full, no checkpointing": ["lora.enabled=false", "sharding.activation_checkpointing=false"],
    "lora, chunked loss": ["train.chunked_loss=true"],
    "lora, chunked attention": ["model.attn_implementation=chunked"],
    "lora, accumulation 2": ["train.gradient_accumulation_steps=2"],
    "qlora int8": ["model.quantize=int8"],
    "qlora int4": ["model.quantize=int4", "model.quantize_group_size=16"],
}
SHAPES = {"tiny": ["data.max_length=64", "train.global_batch_size=64"], "mini": ["data.max_length=512"]}
BATCH = {("mini", 8): 32, ("mini", 1): 4}


def point(model: str, device: str, overrides: list[str], mini_dir: Path) -> dict:
    target = DEVICES[device]
    shape = [*SHAPES[model]]
    if model == "mini":
        shape += [f"model.name_or_path={mini_dir}", f"train.global_batch_size={BATCH[model, target.devices]}"]
    overrides = [*COMMON, *shape, *overrides, "runtime.device=tpu"]
    recipe = load_recipe(str(ROOT / "recipes" / "tiny_lora_cpu.yaml"), overrides)
    planned = plan_recipe(recipe, device).plan.peak
    started = time.perf_counter()
    compiled = compile_recipe(recipe, target)
    return {
        "planned": planned,
        "compiled": compiled.needed,
        "error": (planned - compiled.needed) / compiled.needed,
        "arguments": compiled.arguments,
        "temporaries": compiled.temporaries,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,mini")
    parser.add_argument("--devices", default="v5e-8,v5e-1")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    mini_dir = Path(tempfile.mkdtemp(prefix="lowmem-mini-"))
    (mini_dir / "config.json").write_text(json.dumps(MINI))
    rows = []
    print("| model | device | point | planner | TPU compiler | error |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for device in args.devices.split(","):
            for name, overrides in POINTS.items():
                if args.only is not None and name not in args.only:
                    continue
                try:
                    row = point(model, device, overrides, mini_dir)
                except UserError as err:
                    print(f"| {model} | {device} | {name} | error: {err} | | |", flush=True)
                    continue
                rows.append({"model": model, "device": device, "point": name, "overrides": overrides} | row)
                mib = 2**20
                print(
                    f"| {model} | {device} | {name} | {row['planned'] / mib:.1f} MiB | {row['compiled'] / mib:.1f} MiB "
                    f"| {row['error']:+.1%} |",
                    flush=True,
                )
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(f"\nworst: {worst['model']} on {worst['device']}, {worst['point']}: {worst['error']:+.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
