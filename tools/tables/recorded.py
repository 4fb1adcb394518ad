"""Tables of the benchmarks' recorded results (benchmarks/results/)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from lowmem_tpu.config.devices import GiB

from .common import RESULTS, ROOT

sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the fault matrix's harness, test support
from fault_matrix import table as fault_matrix_table


def tpu_grid_table() -> str:
    """docs/memory_calibration.md: the planner against the TPU compiler over a grid of levers
    (benchmarks/results/tpu_planner_grid.json: ``benchmarks/tpu_planner_grid.py --replan --pivot`` prints it)."""
    rows = json.loads((RESULTS / "tpu_planner_grid.json").read_text())
    columns = [(m, d) for m in ("w3b", "mini", "tiny") for d in ("v5e-8", "v5e-1")]
    cells = {(r["model"], r["device"], r["point"]): r for r in rows}
    points = list(dict.fromkeys(r["point"] for r in rows))
    lines = ["| point | " + " | ".join(f"{m} {d}" for m, d in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in points:
        found = [cells.get((m, d, name)) for m, d in columns]
        text = [f"{r['compiled'] / 2**20:.1f} ({r['error']:+.0%})" if r else "" for r in found]
        lines.append(f"| {name} | " + " | ".join(text) + " |")
    lines.append("")
    beyond_tiny, width_3b = [r for r in rows if r["model"] != "tiny"], [r for r in rows if r["model"] == "w3b"]
    for label, chosen in (("worst", rows), ("worst beyond tiny", beyond_tiny), ("worst at 3B width", width_3b)):
        worst = max(chosen, key=lambda r: abs(r["error"]))
        lines.append(f"- {label}: {worst['model']} on {worst['device']}, {worst['point']}: {worst['error']:+.1%}")
    return "\n".join(lines)


def tpu_only_paths_table() -> str:
    """docs/memory_calibration.md: the TPU-only paths compiled for a TPU (benchmarks/results/tpu_only_paths.json)."""
    rows = json.loads((RESULTS / "tpu_only_paths.json").read_text())
    lines = [
        "| point (the recipe's width, 4 layers) | needed (HBM) | arguments | temporaries | Pallas kernels | planner |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("needed"):
            lines.append(f"| {r['point']} | not compiled: {r.get('error', '')} | | | | |")
            continue
        error = (r["planned"] - r["needed"]) / r["needed"]
        lines.append(
            f"| {r['point']} | {r['needed'] / GiB:.2f} | {r['arguments'] / GiB:.2f} | {r['temporaries'] / GiB:.2f} "
            f"| {r['kernels']} | {r['planned'] / GiB:.2f} ({error:+.0%}) |"
        )
    return "\n".join(lines)


def fault_table() -> str:
    """docs/faults.md: the fault matrix's record (benchmarks/results/fault_matrix.json), as the benchmark prints it."""
    record = json.loads((RESULTS / "fault_matrix.json").read_text())
    cases = record["cases"]
    survived = sum(bool(c["survived"]) for c in cases)
    return f"{fault_matrix_table(cases)}\n\n**{survived} of {len(cases)} killed runs survived.**"


def benchmark_table(benchmark: str, *args: str) -> Callable[[], str]:
    """A benchmark's table of its recorded result, as ``python benchmarks/NAME.py [ARGS] --table`` prints it."""

    def run() -> str:
        import subprocess

        command = [sys.executable, str(ROOT / "benchmarks" / f"{benchmark}.py"), *args, "--table"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    return run


def line_check_table() -> str:
    """docs/tpu_compiler.md: the line through the cut compiles against compiles at more layers or whole
    (benchmarks/results/line_check.json: ``tools/tpu_compile_recipes.py --line-check``)."""
    checks = json.loads((RESULTS / "line_check.json").read_text())
    rows = [
        "| recipe | target | layers | compiled: held per chip | the line | its error | cycles | interconnect bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(checks.values(), key=lambda c: (c["recipe"], c["layers"])):
        held, cycles, received = c["held"], c["cycles"], c["received"]
        rows.append(
            f"| `{c['recipe']}` | {c['device']} | {c['layers']} | {held[0] / GiB:.2f} GiB | {held[1] / GiB:.2f} GiB "
            f"| {held[2]:+.2%} | {cycles[2]:+.2%} | {received[2]:+.2%} |"
        )
    return "\n".join(rows)


def line_error() -> str:
    """The line's error an extrapolated record keeps as margin (measure.tpu_layers.LINE_ERROR)."""
    from lowmem_tpu.measure.tpu_layers import LINE_ERROR

    return f"{LINE_ERROR:.0%}"
