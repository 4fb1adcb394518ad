"""What each of PEFT's LoRA variants costs per chip, by the TPU compiler, on the 3B LoRA recipe.

    python benchmarks/lora_variants.py [--recipe recipes/open_llama_lora.yaml] [--target v5e-8] [--table]

Each variant (``lora.*`` fields: LoRA, rsLoRA, DoRA, LoRA+, PiSSA) is traced with placeholders and compiled
by libtpu at 2 and 4 decoder layers, extrapolated to the model's own count (``lowmem-tpu memory --compile``
does the same when the whole step is too big to compile here). rsLoRA, LoRA+ and PiSSA change a scale, the
optimizer's rates or the adapters' first values: the same program; DoRA adds each adapted weight's norm
to every step. Writes ``benchmarks/results/lora_variants.json``; ``--table`` prints its markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "lora_variants.json"
VARIANTS = {
    "LoRA": [],
    "rsLoRA": ["lora.use_rslora=true"],
    "DoRA": ["lora.use_dora=true"],
    "LoRA+ (ratio 16)": ["lora.loraplus_lr_ratio=16"],
    "PiSSA": ["lora.init_lora_weights=pissa_niter_4"],
}
GIB = 2**30


def compile_variant(recipe_path: str, device_name: str, overrides: list[str]) -> dict:
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.measure.tpu_compile import compile_target
    from lowmem_tpu.measure.tpu_layers import compile_by_layers

    recipe = load_recipe(recipe_path, ["runtime.device=auto", *overrides])
    device = compile_target(device_name)
    with tempfile.TemporaryDirectory(prefix="lowmem-lora-variant-") as tmp:
        result = compile_by_layers(recipe, device, Path(tmp))
    return {
        "overrides": overrides,
        "fits": result.fits,
        "needed": result.needed,
        "arguments": result.arguments,
        "temporaries": result.temporaries,
        "flops": result.cost.get("flops"),
        "extrapolated_from": list(result.extrapolated_from),
    }


def table(result: dict) -> str:
    plain = result["variants"]["LoRA"]
    lines = [
        f"{result['recipe']} on {result['device']}, per chip (libtpu compile-only, {result['layers']}):",
        "",
        "| variant | recipe fields | needed | vs LoRA | temporaries | flops per step (compiler) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["variants"].items():
        fields = " ".join(row["overrides"]) or "(defaults)"
        flops = f"{row['flops']:.3g}" if row.get("flops") else "-"
        more = (row["needed"] - plain["needed"]) / GIB
        lines.append(
            f"| {name} | `{fields}` | {row['needed'] / GIB:.2f} GiB | {more:+.2f} GiB"
            f" | {row['temporaries'] / GIB:.2f} GiB | {flops} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/open_llama_lora.yaml")
    parser.add_argument("--target", default="v5e-8")
    parser.add_argument("--table", action="store_true", help="print the recorded result's table")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return
    variants = {}
    for name, overrides in VARIANTS.items():
        print(f"{name}: compiling at 2 and 4 layers for {args.target}...", file=sys.stderr, flush=True)
        variants[name] = compile_variant(args.recipe, args.target, overrides)
    result = {
        "command": "python benchmarks/lora_variants.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe,
        "device": args.target,
        "layers": "2 and 4 layers compiled, extrapolated",
        "variants": variants,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
