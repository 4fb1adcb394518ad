"""The planner as it is now against every candidate the TPU compiler compiled in the stored tune searches.

    .venv/bin/python benchmarks/replan_searches.py [--rows] [--json FILE]

Each ``benchmarks/results/tune_NAME.json`` holds the compiler's figure (``needed``) for the candidates
``lowmem-tpu tune`` compiled; this re-plans each (the shipped recipe NAME with the candidate's settings and the
overrides the search recorded, nothing compiled) and prints the error by kind of step: one chip or several,
checkpointing, attention. Searches stored before a step recomputing one layer in K was cut at K and 2K layers
keep every_4 rows cut at 2 and 4, which overstate the compiler; those rows are left out. Searches that predate
recording their overrides are re-planned with the recipe as it is now (the open_llama_lora search ran with
``lora.dtype=model``: its rows keep that much more than planned).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from lowmem_tpu.config import load_recipe, with_overrides
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.measure.tune import Candidate
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Searches whose every_4 candidates were compiled at 4 and 8 layers (the others' at 2 and 4).
CUT_AT_K = {"llama3_8b_dpo_v5e8", "llama3_3b_dpo_full_v5e8", "gemma2_9b_lora_v5e8"}
RECIPE = {  # searches named otherwise than their recipe
    "open_llama_lora_v5e8": "open_llama_lora",
    "open_llama_lora_v5e8_placement": "open_llama_lora",
}
NOT_A_RECIPE = ("_rows", "_bnb_layout")  # searches of one knob at another layout


def replanned(path: Path) -> list[dict]:
    name = path.stem.removeprefix("tune_")
    search = json.loads(path.read_text())
    recipe = load_recipe(str(ROOT / "recipes" / f"{RECIPE.get(name, name)}.yaml"))
    device = DEVICES[search["target"]]
    rows = []
    for tried in search["tried"]:
        candidate = Candidate(**tried["settings"])
        if not tried.get("needed") or (candidate.checkpointing == "every_4" and name not in CUT_AT_K):
            continue
        overrides = [*candidate.overrides(device.devices), *search.get("overrides", []), "runtime.device=tpu"]
        trial = with_overrides(recipe, overrides)
        planned = plan_recipe(trial, device.name, require_config(trial)).plan.peak
        rows.append(
            {
                "search": name,
                "target": device.name,
                "candidate": candidate.describe(),
                "spread": "one chip" if device.devices == 1 else "several",
                "checkpointing": str(candidate.checkpointing),
                "attention": candidate.attention,
                "needed": tried["needed"],
                "planned": planned,
                "error": planned / tried["needed"] - 1,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="also print every candidate")
    parser.add_argument("--json", type=Path, help="write every replanned candidate here")
    args = parser.parse_args()
    searches = [p for p in sorted(RESULTS.glob("tune_*.json")) if not p.stem.endswith(NOT_A_RECIPE)]
    rows = [row for path in searches for row in replanned(path)]
    if args.rows:
        for r in rows:
            print(f"{r['search']:28} {r['candidate']:66} {r['needed'] / 2**30:6.2f} GiB  planned {r['error']:+.1%}")
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        groups[(r["spread"], r["checkpointing"], r["attention"])].append(r["error"])
    print("| chips | checkpointing | attention | candidates | mean error | lowest | highest |")
    print("|---|---|---|---|---|---|---|")
    for (spread, ckpt, attention), errors in sorted(groups.items()):
        mean, low, high = sum(errors) / len(errors), min(errors), max(errors)
        print(f"| {spread} | {ckpt} | {attention} | {len(errors)} | {mean:+.1%} | {low:+.1%} | {high:+.1%} |")
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    print(f"{within} of {len(rows)} candidates planned within 10% of the TPU compiler")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
