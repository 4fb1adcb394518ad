"""Every shipped recipe compiled by the TPU compiler for its target (``lowmem-tpu memory --compile``).

Run by ``make tpu-compile-check`` (CI: .ci/run) as ``python tools/tpu_compile_recipes.py --check --timeout 1200``,
and by hand after a change to a shipped recipe's step (docs/tpu_compile.json's figures, the README's table):

    .venv/bin/python tools/tpu_compile_recipes.py [--only NAME ...] [--out docs/tpu_compile.json] [--check]

Each recipe's steady training step is traced on the CPU backend with placeholders for its weights
and compiled with libtpu's compile-only client for its ``runtime.target`` (the tiny CPU demo for
v5e-8 and v5e-1). Prints the README's table (the compiler's figure per chip beside the plan) and
writes the figures as JSON.

``--check`` (CI) exits 1 when a shipped recipe does not fit its target. Tracing takes seconds, a 3B
compile minutes: with ``--check`` a recipe whose traced program is byte for byte the one recorded in
``--out`` (same program, target, libtpu, jax and compile step: ``program_key``) keeps its recorded
figures, and every other is compiled again. So any change to a shipped recipe's step is compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from lowmem_tpu.config import Recipe, load_recipe
from lowmem_tpu.config.shipped import describe_shipped
from lowmem_tpu.console import size
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.tpu_compile import (
    CompileTooLong,
    HostMemoryExhausted,
    cleanup_on_sigterm,
    compile_target,
    compile_traced,
    trace_step,
)
from lowmem_tpu.measure.tpu_layers import (
    WHOLE_LIMIT,
    compile_points,
    extrapolate,
    layer_points,
    layers_of,
    trace_cut,
)
from lowmem_tpu.measure.tpu_report import compile_beside_plan

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
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one compile may take here")
    parser.add_argument(
        "--layers", action="store_true", help="compile at 2 and 4 layers (K, 2K for every_K), extrapolated, not whole"
    )
    parser.add_argument(
        "--whole-limit",
        type=float,
        default=WHOLE_LIMIT,
        help="seconds the whole step may compile before 2 and 4 layers are compiled instead",
    )
    parser.add_argument(
        "--line-check",
        action="store_true",
        help="compile --only recipes at 2 and 4 layers: the line's error against their whole compile in --out, "
        "or against compiles at --at layers",
    )
    parser.add_argument("--at", type=int, nargs="*", default=[], help="with --line-check: layer counts to compile")
    parser.add_argument("--checks", type=Path, default=ROOT / "benchmarks" / "results" / "line_check.json")
    args = parser.parse_args()
    cleanup_on_sigterm()
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.line_check:
        return line_check(args.only or [], recorded, args.timeout, args.at, args.checks)
    rows, records, failed, blocked = [], {}, [], []
    for name, device, path in targets():
        if args.only is not None and name not in args.only:
            continue
        key = f"{name}@{device}"
        try:
            limit = 0.0 if args.layers else args.whole_limit
            record = _compiled(name, device, path, recorded.get(key) if args.check else None, args.timeout, limit)
        except UserError as err:
            print(f"  error: {err}", file=sys.stderr)
            failed.append(f"{key}: {err}")
            continue
        records[key] = record
        rows.append(_row(name, device, record))
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        if record.get("blocked"):
            blocked.append(f"{key}: {record['blocked']}")
        elif not record["fits"]:
            held, free = size(record.get("held", record["needed"])), size(record.get("free"))
            failed.append(f"{key}: {held} held of {size(record['capacity'])}, {free} free")
    written = {key: {k: v for k, v in record.items() if k != "reused"} for key, record in (recorded | records).items()}
    args.out.write_text(json.dumps(written, indent=2) + "\n")
    print("| recipe | target | TPU compiler, per chip (a GiB kept free) | planner (error) | TPU compile | host peak |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if blocked:
        print("\n".join(["", "not compiled on this machine:", *blocked]), file=sys.stderr)
    if failed:
        print("\n".join(["", "not fitting or failed:", *failed]), file=sys.stderr)
    return 1 if args.check and failed else 0


def _compiled(name: str, device: str, path: Path, recorded: dict | None, timeout: float, whole_limit: float) -> dict:
    """One recipe's record: traced now; compiled now unless ``recorded`` holds the same program's figures."""
    target = compile_target(device)
    recipe = load_recipe(str(path), ["runtime.device=tpu"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lowmem-recipes-") as tmp:
        print(f"[{name} on {device}] tracing...", file=sys.stderr, flush=True)
        traced = trace_step(recipe, target, Path(tmp))
        if recorded and recorded.get("program_key") == traced.key:
            print("  the same program as recorded: its figures stand", file=sys.stderr, flush=True)
            return recorded | _replanned(recipe, device, recorded) | {"reused": True}
        whole_too_big = (recorded or {}).get("whole_blocked")  # known: straight to the layers
        few = layers_of(recipe) <= layer_points(recipe)[-1]
        try:
            try:
                if (whole_too_big or not whole_limit) and not few:
                    raise HostMemoryExhausted(whole_too_big or "not compiled whole here (--layers)")
                print(f"  compiling for {target.topology}...", file=sys.stderr, flush=True)
                result = compile_traced(traced, target, Path(tmp), timeout if few else min(timeout, whole_limit))
                extra = {}
            except (HostMemoryExhausted, CompileTooLong) as err:
                if few:
                    raise
                low, high = layer_points(recipe)
                print(f"  {err}\n  compiling {low} and {high} layers, extrapolated...", file=sys.stderr, flush=True)
                points = compile_points(recipe, target, Path(tmp) / "layers", timeout)
                result = extrapolate(points, layers_of(recipe))
                extra = {"whole_blocked": str(err), "layers": {n: _point(p) for n, p in points.items()}}
        except CompileTooLong as err:
            # Not a verdict on the recipe: this machine cannot run the compiler for it. Said, not failed.
            return {"program_key": traced.key, "device": device, "blocked": str(err), "fits": None}
    _, record, _ = compile_beside_plan(recipe, device, result)
    return record | extra | {"program_key": traced.key, "wall_seconds": round(time.perf_counter() - started, 1)}


def line_check(names: list[str], recorded: dict, timeout: float, at: list[int], out: Path) -> int:
    """How far the line through the cut compiles (2 and 4 layers; K and 2K for every_K) lands from a compile at
    more layers: each of ``at`` (or the whole step, from ``recorded``): what the chip holds, the compiler's
    cycles and the interconnect's bytes. Writes them into ``out`` (benchmarks/results/line_check.json), the
    record measure.tpu_layers.LINE_ERROR is held against."""
    checks = json.loads(out.read_text()) if out.exists() else {}
    print("| recipe | target | layers | compiled: held | the line | error | cycles error | interconnect error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, device, path in targets():
        if name not in names:
            continue
        recipe = load_recipe(str(path), ["runtime.device=tpu"])
        target = compile_target(device)
        with tempfile.TemporaryDirectory(prefix="lowmem-line-") as tmp:
            points = compile_points(recipe, target, Path(tmp), timeout)
            references = {
                n: compile_traced(
                    trace_cut(recipe, target, n, Path(tmp), timeout), target, Path(tmp) / f"at-{n}", timeout
                )
                for n in at
            }
        if not at:
            whole = recorded.get(f"{name}@{device}", {})
            if not whole.get("needed") or whole.get("extrapolated_from"):
                print(f"  {name}@{device}: no whole compile recorded; give --at N", file=sys.stderr)
                continue
            references = {layers_of(recipe): whole}
        for n, reference in references.items():
            check = _line_against(extrapolate(points, n), reference)
            checks[f"{name}@{device}@{n}"] = {"recipe": name, "device": device, "layers": n} | check
            print(
                f"| {name} | {device} | {n} | {size(check['held'][0])} | {size(check['held'][1])} "
                f"| {check['held'][2]:+.2%} | {check['cycles'][2]:+.2%} | {check['received'][2]:+.2%} |",
                flush=True,
            )
    out.write_text(json.dumps(checks, indent=2) + "\n")
    return 0


def _line_against(line, reference) -> dict:
    """(compiled, the line, the line's error) for what the chip holds, the cycles and the interconnect bytes."""
    reference = reference if isinstance(reference, dict) else _point(reference) | {"step": reference.step}
    line_point = _point(line) | {"step": line.step}
    held = [p["needed"] + p.get("generated_code", 0) for p in (reference, line_point)]
    cycles = [p["step"].get("cycles", 0) for p in (reference, line_point)]
    received = [sum(p["step"].get("received", {}).values()) for p in (reference, line_point)]
    return {
        key: [a, b, (b - a) / a if a else 0.0]
        for key, (a, b) in (("held", held), ("cycles", cycles), ("received", received))
    }


def _point(result) -> dict:
    """One compile at fewer layers, as the record keeps it."""
    keys = ("needed", "arguments", "temporaries", "generated_code", "compile_seconds", "host_peak_rss_bytes")
    return {key: getattr(result, key) for key in keys}


def _replanned(recipe: Recipe, device: str, recorded: dict) -> dict:
    """The planner's figure beside recorded compiler figures, from the planner as it is now (arithmetic, instant)."""
    if recorded.get("blocked") or not recorded.get("needed"):
        return {}
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config

    planned = plan_recipe(recipe, device, require_config(recipe)).plan.peak
    return {"planned_peak": planned, "plan_error": (planned - recorded["needed"]) / recorded["needed"]}


def _row(name: str, device: str, record: dict) -> str:
    if record.get("blocked"):
        return f"| {name} | {device} | not compiled here: {record['blocked'].split(':')[0]} | | | |"
    verdict = "fits" if record["fits"] else "**does not fit**"
    if record.get("extrapolated_from"):
        verdict += " (extrapolated from {} and {} layers)".format(*record["extrapolated_from"])
    error = f"{record['plan_error']:+.0%}" if record.get("plan_error") is not None else "n/a"
    return (
        f"| {name} | {device} | {size(record.get('held', record['needed']))} held of {size(record['capacity'])}, "
        f"{size(record.get('free'))} free: {verdict} "
        f"| {size(record.get('planned_peak'))} ({error}) | {record['compile_seconds']:.0f} s "
        f"| {size(record['host_peak_rss_bytes'])} |"
    )


if __name__ == "__main__":
    sys.exit(main())
