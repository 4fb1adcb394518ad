"""The TPU-only paths (flash attention, dropout's mask, quantized bases) compiled by the TPU compiler.

    .venv/bin/python benchmarks/tpu_only_paths.py [--layers 4] [--only NAME ...] [--json benchmarks/results/X.json]

Each point is a shipped Open Llama recipe (``open_llama_lora.yaml`` on v5e-8, ``open_llama_lora_v5e1.yaml``
on v5e-1, ``open_llama_full.yaml``, ``open_llama_7b_qlora.yaml`` on v5e-1) on the model's exact width
(3B: hidden 3200, 32 heads of 100, MLP 8640, vocabulary 32,000; 7B: hidden 4096, MLP 11008) with
``--layers`` decoder layers instead of 26 or 32 (what a layer costs is the same; the compile takes two
minutes instead of seven, and a 7B step fits this machine's RAM), its steady step traced with placeholders
and compiled for the target by libtpu's compile-only client (``lowmem-tpu memory --compile``). Per chip:
what the step needs (arguments + outputs - aliased + temporaries, HBM), the host memory it uses, the
Pallas kernels in it, and the planner's peak for the same recipe. Prints a markdown table; ``--json``
keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.tpu_compile import compile_recipe
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "lowmem_tpu" / "model_configs"
WIDTH = {"3b": "openlm-research__open_llama_3b_v2.json", "7b": "openlm-research__open_llama_7b_v2.json"}
# Not a recipe field: libtpu's flag as a user would set it, undoing the one lowmem-tpu sets (xla/runtime.py).
NOT_PARTITIONED = "LIBTPU_INIT_ARGS=--xla_tpu_spmd_rng_bit_generator_unsafe=false"
RECIPE = {"v5e-8": "open_llama_lora", "v5e-1": "open_llama_lora_v5e1"}


def _attention(device: str) -> dict[str, tuple[str, list[str]]]:
    points = {}
    for length in (1024, 2048):
        for attention in ("eager", "chunked", "flash"):
            over = [f"data.max_length={length}", f"model.attn_implementation={attention}"]
            points[f"{attention}, {length}"] = (RECIPE[device], over)
        points[f"flash, {length}, packed"] = (RECIPE[device], [*over, "data.packing=true"])
    return {f"{device}: {name}": value for name, value in points.items()}


POINTS: dict[str, tuple[str, list[str]]] = {
    **_attention("v5e-8"),
    **_attention("v5e-1"),
    # sharding.offload_activations was compiled here at commit 60234b5 (before the recipe refused it).
    "v5e-8: lora, dropout 0.05": ("open_llama_lora", ["lora.dropout=0.05"]),
    "v5e-8: lora, dropout 0.05, bits not partitioned": ("open_llama_lora", ["lora.dropout=0.05", NOT_PARTITIONED]),
    "v5e-8: lora, dropout 0": ("open_llama_lora", ["lora.dropout=0.0"]),
    # Open Llama 7B's width: the int4 and int8 bases dequantized per matmul, beside the bf16 base.
    "v5e-1: 7b int4": ("open_llama_7b_qlora", []),
    "v5e-1: 7b int8": ("open_llama_7b_qlora", ["model.quantize=int8"]),
    "v5e-1: 7b bf16": ("open_llama_7b_qlora", ["model.quantize=none"]),
}


def point(recipe_name: str, overrides: list[str], device: str, models: Path) -> dict:
    width = "7b" if "7b" in recipe_name else "3b"
    common = [f"model.name_or_path={models / width}", "runtime.device=tpu", "train.eval_samples=0"]
    env = [o.split("=", 1)[1] for o in overrides if o.startswith("LIBTPU_INIT_ARGS=")]
    overrides = [o for o in overrides if not o.startswith("LIBTPU_INIT_ARGS=")]
    recipe = load_recipe(str(ROOT / "recipes" / f"{recipe_name}.yaml"), [*common, *overrides])
    planned = plan_recipe(recipe, device, require_config(recipe)).plan.peak
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(env)  # the compiler's subprocess starts with it
    compiled = compile_recipe(recipe, DEVICES[device])
    return {
        "planned": planned,
        "needed": compiled.needed,
        "fits": compiled.fits,
        "arguments": compiled.arguments,
        "temporaries": compiled.temporaries,
        "host": compiled.host,
        "kernels": compiled.kernels,
        "compile_seconds": compiled.compile_seconds,
        "refused": compiled.refused is not None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="point names (or a prefix such as 'v5e-1')")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    models = Path(tempfile.mkdtemp(prefix="lowmem-widths-"))
    for width, name in WIDTH.items():
        (models / width).mkdir()
        config = json.loads((CONFIGS / name).read_text()) | {"num_hidden_layers": args.layers}
        (models / width / "config.json").write_text(json.dumps(config))
    rows = []
    gib = 2**30
    print(f"Open Llama 3B's (7b: 7B's) width, {args.layers} layers; per chip, GiB")
    print("| point | needed (HBM) | arguments | temporaries | host | kernels | planner | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (recipe_name, overrides) in POINTS.items():
        if args.only is not None and not any(name.startswith(o) for o in args.only):
            continue
        device = name.split(":")[0]
        try:
            row = point(recipe_name, overrides, device, models)
        except UserError as err:
            print(f"| {name} | error: {str(err).splitlines()[0][:200]} | | | | | | |", flush=True)
            rows.append({"point": name, "recipe": recipe_name, "overrides": overrides, "error": str(err)})
            continue
        rows.append({"point": name, "recipe": recipe_name, "overrides": overrides, "layers": args.layers} | row)
        needed = f"{row['needed'] / gib:.2f}" + (" (refused)" if row["refused"] else "")
        print(
            f"| {name} | {needed} | {row['arguments'] / gib:.2f} | {row['temporaries'] / gib:.2f} | "
            f"{row['host'] / gib:.2f} | {row['kernels']} | {row['planned'] / gib:.2f} | {row['compile_seconds']:.0f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
