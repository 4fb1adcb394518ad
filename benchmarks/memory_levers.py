"""Each memory lever, planned beside the CPU compiler's figure for the real step (tiny Llama, fp32).

    python benchmarks/memory_levers.py [--model tiny|mini] [--devices 4] [--length 512] [--batch 64] [--json F]

For every point the recipe is the embedded tiny one (or ``--model mini``: Open Llama's proportions,
4 layers: benchmarks/mini_llama.json) at ``--length`` tokens, ``--batch`` sequences per step,
with the lever's overrides; the step is compiled (not run) on ``--devices`` CPU devices with the
memory-minimizing scheduler, and the largest program's per-device bytes are read (with
accumulation: the largest micro-batch program). Prints a Markdown table: planned (CPU layout),
measured, the planner's error, and the planned TPU-layout figure for the same setting.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.measure.local import compile_step
from lowmem_tpu.memory.plan import plan_setting
from lowmem_tpu.memory.shape import setting_of, shape_of
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[1]

OFF = "sharding.activation_checkpointing=false"
CHUNKED = ["model.attn_implementation=chunked"]
POINTS = {  # name -> overrides
    "plain (checkpointing on)": [],
    "checkpointing off": [OFF],
    "checkpointing one layer in two": ["sharding.activation_checkpointing=every_2"],
    "accumulation 2": ["train.gradient_accumulation_steps=2"],
    "accumulation 4": ["train.gradient_accumulation_steps=4"],
    "chunked loss": ["train.chunked_loss=true"],
    "chunked attention": CHUNKED,
    "chunked attention, checkpointing off": [*CHUNKED, OFF],
    "packing (segment mask, eager)": ["data.packing=true"],
    "chunked attention and loss": [*CHUNKED, "train.chunked_loss=true"],
    "all: accumulation 4, chunked attention and loss": [
        *CHUNKED,
        "train.chunked_loss=true",
        "train.gradient_accumulation_steps=4",
    ],
}

# --model mini (benchmarks/mini_llama.json): Open Llama 3B's proportions (head size 100, intermediate 2.7 x
# hidden, vocabulary 32000) at 4 layers of hidden 400, so the loss's [tokens, vocab] buffers weigh as they do there.
MINI = json.loads((Path(__file__).resolve().parent / "mini_llama.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--only", nargs="*", help="point names to run (default: all)")
    parser.add_argument("--model", choices=("tiny", "mini"), default="tiny")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (all devices)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = [f"data.max_length={args.length}", f"train.global_batch_size={args.batch}"]
    base += [f"runtime.num_cpu_devices={args.devices}"]
    if args.model == "mini":
        directory = Path(tempfile.mkdtemp(prefix="lowmem-mini-"))
        (directory / "config.json").write_text(json.dumps(MINI))
        base += [f"model.name_or_path={directory}"]
    rows = []
    print("| lever | micro-batch / device | planned (CPU layout) | CPU compiler | error | planned (TPU layout) |")
    print("|---|---|---|---|---|---|")
    for name, overrides in POINTS.items():
        if args.only and name not in args.only:
            continue
        recipe = load_recipe(ROOT / "recipes/tiny_lora_cpu.yaml", [*base, *overrides])
        shape, setting = shape_of(require_config(recipe)), setting_of(recipe, args.devices)
        cpu, tpu = (plan_setting(shape, setting, layout, 0).peak for layout in ("cpu", "tpu"))
        measured = compile_step(recipe, args.devices).compiler.total_bytes
        row = {"lever": name, "overrides": overrides, "planned_cpu": cpu, "measured": measured, "planned_tpu": tpu}
        rows.append(row)
        mib = 2**20
        print(
            f"| {name} | {setting.sequences} x {args.length} | {cpu / mib:.1f} MiB | {measured / mib:.1f} MiB | "
            f"{100 * (cpu / measured - 1):+.1f}% | {tpu / mib:.1f} MiB |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
