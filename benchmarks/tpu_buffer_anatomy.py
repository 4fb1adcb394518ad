"""What fills a TPU step's HBM: the kept dumps of ``lowmem-tpu memory --compile`` read apart, per chip.

    .venv/bin/python benchmarks/tpu_buffer_anatomy.py DIR [DIR ...] [--json anatomy.json]

Each DIR is one point kept by ``benchmarks/tpu_planner_grid.py --keep`` (or ``compile_recipe(keep=...)``):
its ``tpu/*after_optimizations-buffer-assignment.txt`` is split into the entry parameters, the HBM
temporaries, how much of those the compiler's tuple tables take, and the on-chip memory (VMEM,
colour 1) beside it. A tuple table (the 512-byte operand list of an async copy or collective, of a
multi-output fusion) gets its own 16 KiB-aligned slot in the temporary arena for the whole program:
in a small program those slots are most of the HBM it needs, which is why the planner (buffers a
model's shape implies) cannot plan one within 10%.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from lowmem_tpu.measure.buffers import hbm_allocations

MiB = 2**20
SLOT = 16 * 1024  # the arena spacing of tuple tables (libtpu 0.0.21, v5e), read off their offsets
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.M)
_TUPLE = re.compile(r"^ value: <\d+ \S+ @0> \(size=512,offset=(\d+)\): \(", re.M)


def arena(text: str) -> str:
    """The largest HBM temporary allocation (the arena) of a buffer assignment, as text."""
    blocks = re.split(r"\n(?=allocation \d+:)", text)
    temporaries = [b for b in blocks if (m := _ALLOCATION.match(b)) and _is_hbm_temporary(m.group(2))]
    return max(temporaries, key=lambda b: int(_ALLOCATION.match(b).group(1)), default="")


def _is_hbm_temporary(rest: str) -> bool:
    return "color" not in rest and " parameter " not in rest and "live-out" not in rest


def anatomy(point: Path) -> dict:
    assignment = next((point / "tpu").glob("*after_optimizations-buffer-assignment.txt"))
    text = assignment.read_text()
    hbm = hbm_allocations(assignment)
    block = arena(text)
    slots = {int(offset) for offset in _TUPLE.findall(block)}
    return {
        "point": point.name,
        "parameters": hbm.parameters,
        "hbm_temporaries": hbm.temporaries,
        "arena": int(_ALLOCATION.match(block).group(1)) if block else 0,
        "tuple_tables": len(slots),
        "tuple_table_bytes": len(slots) * SLOT,
        "on_chip": hbm.scratch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("points", type=Path, nargs="+")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [anatomy(p) for p in args.points if (p / "tpu").is_dir()]
    print("| point | parameters | HBM temporaries | tuple tables (x 16 KiB) | share of them | on-chip (VMEM) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = r["tuple_table_bytes"] / r["hbm_temporaries"] if r["hbm_temporaries"] else 0.0
        print(
            f"| {r['point']} | {r['parameters'] / MiB:.1f} MiB | {r['hbm_temporaries'] / MiB:.1f} MiB "
            f"| {r['tuple_tables']} = {r['tuple_table_bytes'] / MiB:.1f} MiB | {share:.0%} "
            f"| {r['on_chip'] / MiB:.1f} MiB |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
