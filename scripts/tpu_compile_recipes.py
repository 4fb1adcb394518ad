"""Every shipped recipe compiled by the TPU compiler for its target (``lowmem-tpu memory --compile``).

    .venv/bin/python scripts/tpu_compile_recipes.py [--only NAME ...] [--out docs/tpu_compile.json] [--check]

Each recipe's steady training step is traced on the CPU backend with placeholders for its weights
and compiled with libtpu's compile-only client for its ``runtime.target`` (the tiny CPU demo for
v5e-8 and v5e-1). Prints the README's table (the compiler's figure per chip beside the plan) and
writes the figures as JSON. ``--check`` exits 1 when a recipe that ships for a target does not fit it
(CI runs it, so no change can silently break a shipped recipe's fit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.shipped import describe_shipped
from lowmem_tpu.console import size
from lowmem_tpu.errors import UserError
from lowmem_tpu.memory.tpu_compile import compile_beside_plan

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGETS = ("v5e-8", "v5e-1")


def targets() -> list[tuple[str, str, Path]]:
    """(recipe name, device, path) for every shipped recipe and its target."""
    out = []
    for item in describe_shipped():
        for device in [item.target] if item.target and item.target != "cpu" else TINY_TARGETS:
            out.append((item.name, device, item.path))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="recipe names to compile (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "tpu_compile.json")
    parser.add_argument("--check", action="store_true", help="exit 1 when a shipped recipe does not fit its target")
    args = parser.parse_args()
    rows, records, failed = [], {}, []
    for name, device, path in targets():
        if args.only is not None and name not in args.only:
            continue
        print(f"[{name} on {device}] tracing and compiling...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            recipe = load_recipe(str(path), ["runtime.device=tpu"])
            result, record, _ = compile_beside_plan(recipe, device)
        except UserError as err:
            print(f"  error: {err}", file=sys.stderr)
            failed.append(f"{name} on {device}: {err}")
            continue
        record["wall_seconds"] = round(time.perf_counter() - started, 1)
        records[f"{name}@{device}"] = record
        verdict = "fits" if result.fits else "**does not fit**"
        planned = record.get("planned_peak")
        error = f"{record['plan_error']:+.0%}" if record.get("plan_error") is not None else "n/a"
        rows.append(
            f"| {name} | {device} | {size(result.needed)} of {size(result.capacity)}: {verdict} "
            f"| {size(planned)} ({error}) | {result.compile_seconds:.0f} s | {size(result.host_peak_rss_bytes)} |"
        )
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        if not result.fits:
            failed.append(f"{name} on {device}: {size(result.needed)} of {size(result.capacity)}")
    previous = json.loads(args.out.read_text()) if args.out.exists() and args.only is not None else {}
    args.out.write_text(json.dumps(previous | records, indent=2) + "\n")
    print("| recipe | target | TPU compiler, per chip | planner (error) | TPU compile | host peak |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if failed:
        print("\n".join(["", "not fitting or failed:", *failed]), file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
