"""Each memory lever, planned beside the CPU compiler's figure for the real step (tiny Llama, fp32).

    python scripts/memory_levers.py [--devices 4] [--length 128] [--json levers.json]

For every point the recipe is the embedded tiny one at ``--length`` tokens, 64 sequences per step,
with the lever's overrides; the step is compiled (not run) on ``--devices`` CPU devices with the
memory-minimizing scheduler, and the largest program's per-device bytes are read (with
accumulation: the largest micro-batch program). Prints a Markdown table: planned (CPU layout),
measured, the planner's error, and the planned TPU-layout figure for the same setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem_tpu.config import load_recipe  # noqa: E402
from lowmem_tpu.memory.measure import compile_step  # noqa: E402
from lowmem_tpu.memory.plan import plan_setting  # noqa: E402
from lowmem_tpu.memory.shape import require_config, setting_of, shape_of  # noqa: E402

POINTS = {  # name -> overrides
    "plain (checkpointing on)": [],
    "checkpointing off": ["sharding.activation_checkpointing=false"],
    "accumulation 2": ["train.gradient_accumulation_steps=2"],
    "accumulation 4": ["train.gradient_accumulation_steps=4"],
    "chunked attention": ["model.attn_implementation=chunked"],
    "chunked attention, checkpointing off": [
        "model.attn_implementation=chunked",
        "sharding.activation_checkpointing=false",
    ],
    "accumulation 4, checkpointing off": [
        "train.gradient_accumulation_steps=4",
        "sharding.activation_checkpointing=false",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--only", nargs="*", help="point names to run (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = [f"data.max_length={args.length}", "train.global_batch_size=64", f"runtime.num_cpu_devices={args.devices}"]
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
