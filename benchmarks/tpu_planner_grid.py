"""The planner's TPU layout against the TPU compiler (libtpu's compile-only client), over a grid of levers.

    .venv/bin/python benchmarks/tpu_planner_grid.py [--models tiny,mini,w3b] [--devices v5e-8,v5e-1]
                                                   [--only NAME ...] [--json benchmarks/results/tpu_planner_grid.json]
                                                   [--keep DIR]
    .venv/bin/python benchmarks/tpu_planner_grid.py --json benchmarks/results/tpu_planner_grid.json --replan [--pivot]

Each point is ``recipes/tiny_lora_cpu.yaml`` with overrides, its steady step traced with placeholders
and compiled for the device (``lowmem-tpu memory --compile``), beside the planner's peak for the same
recipe and device. ``mini`` has Open Llama 3B's proportions (head size 100, MLP 2.7 x hidden, vocabulary
32,000) at 4 layers of hidden 400; ``w3b`` is Open Llama 3B itself cut to 4 of its 26 layers, at the shipped
recipes' batch (32 x 1024 tokens on v5e-8, 4 x 1024 on v5e-1). The whole 3B is the shipped recipes
(tools/tpu_compile_recipes.py).
Prints a markdown table and the worst point; ``--json`` keeps every figure (points compiled again replace
theirs), and ``--replan`` puts the planner as it is now beside the recorded compiler figures, compiling
nothing (a 3B-width point takes about 5 minutes to compile here, the whole grid hours).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from lowmem_tpu.config import Recipe, load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.tpu_compile import compile_recipe
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[1]
# memory_levers.py's ``mini``: Open Llama 3B's proportions at 4 layers of hidden 400.
MINI = json.loads((Path(__file__).resolve().parent / "mini_llama.json").read_text())
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
    "qlora int4": ["model.quantize=int4", "model.quantize_group_size=32"],
}
SHAPES = {
    "tiny": ["data.max_length=64", "train.global_batch_size=64"],
    "mini": ["data.max_length=512"],
    "w3b": ["data.max_length=1024"],
}
BATCH = {("mini", 8): 32, ("mini", 1): 4, ("w3b", 8): 32, ("w3b", 1): 4}
OPEN_LLAMA_3B = ROOT / "lowmem_tpu" / "model_configs" / "openlm-research__open_llama_3b_v2.json"


def configs(work: Path) -> dict[str, Path]:
    """The models built from configs: ``mini`` and ``w3b`` (Open Llama 3B at 4 layers), written under ``work``."""
    w3b = json.loads(OPEN_LLAMA_3B.read_text()) | {"num_hidden_layers": 4}
    dirs = {}
    for name, config in (("mini", MINI), ("w3b", w3b)):
        (work / name).mkdir()
        (work / name / "config.json").write_text(json.dumps(config))
        dirs[name] = work / name
    return dirs


def recipe_of(model: str, device: str, overrides: list[str], models: dict[str, Path]) -> Recipe:
    """The grid point's recipe: the tiny recipe in bf16 with the model's shape and the point's levers."""
    shape = [*SHAPES[model]]
    if model in models:
        batch = BATCH[model, DEVICES[device].devices]
        shape += [f"model.name_or_path={models[model]}", f"train.global_batch_size={batch}"]
    tiny = str(ROOT / "recipes" / "tiny_lora_cpu.yaml")
    return load_recipe(tiny, [*COMMON, *shape, *overrides, "runtime.device=tpu"])


def planned(row: dict, models: dict[str, Path]) -> dict:
    """The planner's peak for a row's recipe, from the planner as it is now, and its error against the compiler."""
    recipe = recipe_of(row["model"], row["device"], row["overrides"], models)
    peak = plan_recipe(recipe, row["device"], require_config(recipe)).plan.peak
    return row | {"planned": peak, "error": (peak - row["compiled"]) / row["compiled"]}


def point(model: str, device: str, overrides: list[str], models: dict[str, Path], keep: Path | None = None) -> dict:
    started = time.perf_counter()
    compiled = compile_recipe(recipe_of(model, device, overrides, models), DEVICES[device], keep=keep)
    row = {"model": model, "device": device, "overrides": overrides, "compiled": compiled.needed}
    row |= {"arguments": compiled.arguments, "temporaries": compiled.temporaries, "resident": compiled.resident}
    return planned(row | {"seconds": round(time.perf_counter() - started, 1)}, models)


def print_row(row: dict) -> None:
    mib = 2**20
    print(
        f"| {row['model']} | {row['device']} | {row['point']} | {row['planned'] / mib:.1f} MiB "
        f"| {row['compiled'] / mib:.1f} MiB | {row['error']:+.1%} |",
        flush=True,
    )


def print_pivot(rows: list[dict]) -> None:
    """The grid as docs/memory.md shows it: a row per point, the compiler's figure and the error per column."""
    columns = [(m, d) for m in ("w3b", "mini", "tiny") for d in ("v5e-8", "v5e-1")]
    cells = {(r["model"], r["device"], r["point"]): r for r in rows}
    print("| point | " + " | ".join(f"{m} {d}" for m, d in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in POINTS:
        found = [cells.get((m, d, name)) for m, d in columns]
        text = [f"{r['compiled'] / 2**20:.1f} ({r['error']:+.0%})" if r else "" for r in found]
        print(f"| {name} | " + " | ".join(text) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,mini,w3b")
    parser.add_argument("--devices", default="v5e-8,v5e-1")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", type=Path, default=None, help="the grid's figures (compiled points replace theirs)")
    parser.add_argument("--replan", action="store_true", help="compile nothing: re-plan every point in --json")
    parser.add_argument("--keep", type=Path, default=None, help="keep each point's trace and TPU dumps under DIR")
    parser.add_argument("--pivot", action="store_true", help="also print the grid a row per point (docs/memory.md)")
    args = parser.parse_args()
    models = configs(Path(tempfile.mkdtemp(prefix="lowmem-grid-")))
    recorded = json.loads(args.json.read_text()) if args.json and args.json.exists() else []
    grid = {(r["model"], r["device"], r["point"]): r for r in recorded}
    print("| model | device | point | planner | TPU compiler | error |")
    print("|---|---|---|---|---|---|")
    if args.replan:
        grid = {key: planned(row, models) for key, row in grid.items()}
        for row in grid.values():
            print_row(row)
    for model in [] if args.replan else args.models.split(","):
        for device in args.devices.split(","):
            for name, overrides in POINTS.items():
                if args.only is not None and name not in args.only:
                    continue
                label = f"{model}-{device}-{name}".replace(" ", "").replace(",", "-")
                try:
                    row = point(model, device, overrides, models, args.keep / label if args.keep else None)
                except UserError as err:
                    print(f"| {model} | {device} | {name} | error: {err} | | |", flush=True)
                    continue
                grid[model, device, name] = row | {"point": name}
                print_row(grid[model, device, name])
                if args.json:  # every point as it comes: a long grid stopped early keeps what it measured
                    args.json.write_text(json.dumps(list(grid.values()), indent=2) + "\n")
    rows = list(grid.values())
    if rows:
        beyond_tiny, width_3b = [r for r in rows if r["model"] != "tiny"], [r for r in rows if r["model"] == "w3b"]
        for label, chosen in (("worst", rows), ("worst beyond tiny", beyond_tiny), ("worst at 3B width", width_3b)):
            if chosen:
                worst = max(chosen, key=lambda r: abs(r["error"]))
                print(f"{label}: {worst['model']} on {worst['device']}, {worst['point']}: {worst['error']:+.1%}")
    if args.pivot:
        print_pivot(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
