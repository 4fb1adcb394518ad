"""The fault matrix: a run SIGKILLed at every fault point resumes to the uninterrupted run's weights, bit for bit.

    python benchmarks/fault_matrix.py [--quick] [--modes lora,full] [--cases save-state:2,final-publish]
                                      [--json PATH] [--work DIR] [--keep]
    python benchmarks/fault_matrix.py --json benchmarks/results/fault_matrix.json   # the record docs/faults.md cites

The runs and checks are ``tests/helpers/fault_matrix.py``'s (``tests/e2e/test_faults.py`` runs a LoRA subset of
them). For each mode (LoRA; full fine-tuning with ``lora.enabled=false``; with ``--modes dpo``, LoRA DPO,
whose command is ``lowmem-tpu dpo recipes/tiny_dpo_cpu.yaml``) the tiny CPU recipe runs once
uninterrupted (``lowmem-tpu sft recipes/tiny_lora_cpu.yaml`` with the overrides in ``RUN``: 6 steps, a
checkpoint every 2, two kept, dropout on, two micro-batches per step). Then, for each case, the same command
runs with ``LOWMEM_TPU_KILL_AT=CASE`` (``lowmem_tpu.faults``: the process SIGKILLs itself at that point, the
N-th time for ``POINT:N``), which must end it with SIGKILL; the directory it leaves is checked (every
``checkpoints/step-N`` whole and loadable, ``final/`` whole if present, every data cache entry readable;
half-written ones only under names the next run removes or ignores); then the same command runs again,
unchanged, and must finish (exit 0) with ``final/*.safetensors`` equal to the uninterrupted run's, tensor by
tensor and byte for byte. It prints a table (fault point, mode, tried, survived) and each case; ``--json``
writes them. Exits 1 if any case fails. Each case costs two runs (about two minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the harness is test support

from fault_matrix import CASES, MODES, QUICK, RECIPE, RUN, reference, run_case, summary, table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset: " + json.dumps(QUICK))
    parser.add_argument("--modes", default="lora,full", help="lora, full and/or dpo (default: lora,full)")
    parser.add_argument("--cases", default="", help="comma-separated cases (default: all of CASES)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "fault_matrix", help="run directories")
    parser.add_argument("--keep", action="store_true", help="keep the run directories of cases that survived")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    chosen = [c for c in args.cases.split(",") if c]
    started, results = time.perf_counter(), []
    for mode in modes:
        cases = chosen or (QUICK[mode] if args.quick else [c for c, _ in CASES if c != "base" or mode != "full"])
        print(f"{mode}: the uninterrupted run", flush=True)
        try:
            ref = reference(args.work, mode)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
        for case in cases:
            result = run_case(args.work, mode, case, ref, args.keep)
            results.append(result)
            verdict = "survived" if result["survived"] else "FAILED: " + "; ".join(result["problems"])
            print(f"{mode} {case}: {verdict} ({result['seconds']} s)", flush=True)
    text = table(results)
    print("\n" + text)
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{sum(r['survived'] for r in results)} of {len(results)} cases survived in {minutes:.0f} min")
    if args.json:
        record = {"recipe": RECIPE, "overrides": RUN, "modes": MODES, "summary": summary(results), "cases": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(r["survived"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
