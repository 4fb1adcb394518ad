"""On a TPU: the measured step beside the estimate recorded for it (docs/tpu_compile.json), and one line to send back.

    python benchmarks/tpu_step.py recipes/open_llama_lora.yaml [--steps 30] [KEY=VALUE ...]

Trains the recipe for ``--steps`` steps on the TPU it runs on (``lowmem-tpu sft``, or ``dpo`` for a preference
recipe; a scratch output_dir, no saves, no evaluation) and reads the steady step time and the HBM peak per chip
from the run's metrics.json. The recorded estimate is per program: a micro-batch's when the step accumulates
several (the record's ``resident`` state beside it), the whole step's otherwise; the measured step is divided
by the micro-batches alike (the optimizer's update, once a step, then counts towards each). It prints, per
micro-batch and per step, the measured time beside the estimate's compute, interconnect, HBM and step times,
and the HBM peak beside the TPU compiler's figure, then one line starting ``tpu-step:`` to paste into a
report. Writes ``outputs/tpu_step/RECIPE.json``. Off a TPU it says so and exits 2: the CPU backend's step says
nothing about a TPU's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "tpu_step"
GiB = 2**30


def record_for(name: str, device: str) -> dict:
    records = json.loads((ROOT / "docs" / "tpu_compile.json").read_text())
    return records.get(f"{name}@{device}") or {}


def compared(name: str, device: str, micro: int, measured_step: float, measured_peak: int | None, record: dict) -> dict:
    """The measured figures beside the record's, per micro-batch; ``micro``: micro-batches per step."""
    estimate = record.get("step_estimate") or {}
    out = {
        "recipe": name,
        "device": device,
        "micro_batches_per_step": micro,
        "measured_step_seconds": measured_step,
        "measured_micro_batch_seconds": measured_step / micro,
        "measured_hbm_peak_bytes": measured_peak,
        "compiler_needed_bytes": record.get("needed"),
        "compiler_held_bytes": record.get("held"),
        "estimate": estimate,
    }
    if estimate.get("reported"):
        out["measured_over_estimate"] = out["measured_micro_batch_seconds"] / estimate["step_seconds"]
    if measured_peak and record.get("needed"):
        out["measured_peak_over_compiler"] = measured_peak / record["needed"]
    return out


def summary(r: dict) -> str:
    """The one line to send back."""
    e = r["estimate"]
    ms = {k: e.get(f"{k}_seconds", 0) * 1e3 for k in ("step", "compute", "ici", "hbm")}
    line = (
        f"tpu-step: {r['recipe']} on {r['device']}: measured {r['measured_micro_batch_seconds'] * 1e3:.0f} ms per "
        f"micro-batch ({r['micro_batches_per_step']} a step, {r['measured_step_seconds'] * 1e3:.0f} ms)"
    )
    if e.get("reported"):
        line += (
            f"; estimate {ms['step']:.0f} ms (compute {ms['compute']:.0f}, interconnect {ms['ici']:.0f}, "
            f"HBM {ms['hbm']:.0f}): {r['measured_over_estimate']:.2f}x"
        )
    else:
        line += "; no estimate recorded"
    if r.get("measured_peak_over_compiler"):
        line += (
            f"; HBM peak {r['measured_hbm_peak_bytes'] / GiB:.2f} GiB, compiler {r['compiler_needed_bytes'] / GiB:.2f}"
            f" GiB ({r['measured_peak_over_compiler']:.2f}x)"
        )
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.machine import on_tpu
    from lowmem_tpu.xla.tpu import default_device

    if not on_tpu("auto"):
        print("benchmarks/tpu_step.py measures a TPU's step: run it on a TPU VM", file=sys.stderr)
        return 2
    recipe = load_recipe(str(args.recipe), [*args.overrides, "runtime.target=null"])
    device = default_device(recipe)  # the TPU here
    command = "train"  # the recipe's method: one program per micro-batch
    out = OUT / args.recipe.stem
    run = [
        sys.executable, "-m", "lowmem_tpu.cli", command, str(args.recipe), *args.overrides,
        f"output_dir={out}", f"train.max_steps={args.steps}", f"train.logging_steps={max(args.steps // 6, 1)}",
        f"train.save_steps={args.steps * 10}", "train.eval_samples=0", "data.eval_fraction=0", "hub.push=false",
    ]  # fmt: skip
    done = subprocess.run([*run, "--overwrite"], cwd=ROOT)
    if done.returncode:
        return done.returncode
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    peak = metrics.get("memory", {}).get("per_device_bytes", {}).get("measured_peak")
    micro = recipe.train.gradient_accumulation_steps
    result = compared(
        args.recipe.stem,
        device,
        micro,
        metrics["train"]["steady_step_time"],
        peak,
        record_for(args.recipe.stem, device),
    )
    print(summary(result))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.recipe.stem}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
