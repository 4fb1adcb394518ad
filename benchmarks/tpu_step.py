"""On a TPU: the measured step beside libtpu's cost-model estimate of it (docs/tpu_compile.json).

    python benchmarks/tpu_step.py recipes/open_llama_lora.yaml [--steps 30] [KEY=VALUE ...]

Trains the recipe for ``--steps`` steps on the TPU it runs on (``lowmem-tpu sft``, a scratch
output_dir, no saves, no evaluation), reads the steady step time from the run's metrics.json, and
prints it beside the estimate recorded for that recipe and TPU by ``tools/tpu_compile_recipes.py``:
the first TPU run of a recipe checks the estimate. Writes ``outputs/tpu_step/RECIPE.json``. Off a
TPU it says so and exits 2: the CPU backend's step says nothing about a TPU's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "tpu_step"


def estimate_for(name: str, device: str) -> dict | None:
    records = json.loads((ROOT / "docs" / "tpu_compile.json").read_text())
    return (records.get(f"{name}@{device}") or {}).get("step_estimate")


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
    command = "dpo" if recipe.data.format == "preference" else "sft"  # a DPO recipe's step: its three programs
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
    measured = metrics["train"]["steady_step_time"]
    estimate = estimate_for(args.recipe.stem, device)
    result = {"recipe": args.recipe.stem, "device": device, "measured_step_seconds": measured, "estimate": estimate}
    if estimate and estimate.get("reported"):
        result["measured_over_estimate"] = measured / estimate["step_seconds"]
        print(
            f"{args.recipe.stem} on {device}: measured {measured * 1e3:.0f} ms per step, libtpu's cost model "
            f"{estimate['step_seconds'] * 1e3:.0f} ms ({result['measured_over_estimate']:.2f}x)"
        )
    else:
        print(f"{args.recipe.stem} on {device}: measured {measured * 1e3:.0f} ms per step; no estimate recorded")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.recipe.stem}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
