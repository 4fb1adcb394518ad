"""The adapters in the base's bf16 (``lora.dtype: model``, fp32 masters) against fp32 adapters: the same loss curve.

    python benchmarks/adapter_dtype_loss.py [--steps 50] [--table]

Trains the tiny demo in bf16 (``model.dtype=bfloat16``) for ``--steps`` steps twice, same data, same
seed, on the CPU backend: once with the adapters in bf16 (``lora.dtype=model``: the adapter branch computes
in the base's dtype, the optimizer updates fp32 master copies) and once with PEFT's fp32 adapters (the
default, ``lora.dtype=float32``); the noise is the fp32 run against itself with another seed (43: other
adapters drawn, other batches). Prints both curves' logged losses and the largest differences; writes
``benchmarks/results/adapter_dtype_loss.json``; ``--table`` prints its markdown table from that file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "adapter_dtype_loss.json"
MODES = {"bf16 adapters, fp32 masters (lora.dtype: model)": "model", "fp32 adapters (lora.dtype: float32)": "float32"}


def train(dtype: str, steps: int, out: Path, seed: int = 42) -> list[dict]:
    command = [
        sys.executable, "-m", "lowmem_tpu.cli", "sft", "recipes/tiny_lora_cpu.yaml",
        "model.dtype=bfloat16", f"lora.dtype={dtype}", f"output_dir={out}", f"train.max_steps={steps}",
        "train.logging_steps=5", f"train.save_steps={steps * 10}", "train.eval_samples=0", f"train.seed={seed}",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((out / "final" / "metrics.json").read_text())["train"]["losses"]


def table(result: dict) -> str:
    names = list(result["curves"])
    lines = [
        f"The tiny demo in bf16 on the CPU backend, {result['steps']} steps, seed 42 "
        f"(`python benchmarks/adapter_dtype_loss.py`): the largest difference of the logged losses is "
        f"{result['largest_difference']:.4f} between the two, {result['seed_difference']:.4f} between fp32 "
        f"adapters at seeds 42 and 43 (final losses {result['final'][names[0]]:.4f} and "
        f"{result['final'][names[1]]:.4f}).",
        "",
        f"| step | {' | '.join(names)} |",
        "|---|---|---|",
    ]
    for a, b in zip(*(result["curves"][n] for n in names), strict=True):
        lines.append(f"| {a['step']} | {a['loss']:.4f} | {b['loss']:.4f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return 0
    curves = {}
    with tempfile.TemporaryDirectory(prefix="lowmem-adapter-dtype-") as tmp:
        for name, dtype in MODES.items():
            print(f"training: {name}...", file=sys.stderr, flush=True)
            curves[name] = train(dtype, args.steps, Path(tmp) / dtype)
        print("training: fp32 adapters at seed 43 (the noise)...", file=sys.stderr, flush=True)
        other_seed = train("float32", args.steps, Path(tmp) / "seed43", seed=43)
    a, b = curves.values()
    largest = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))
    result = {
        "steps": args.steps,
        "curves": curves,
        "largest_difference": largest,
        "seed_difference": max(abs(x["loss"] - y["loss"]) for x, y in zip(b, other_seed, strict=True)),
        "final": {name: curve[-1]["loss"] for name, curve in curves.items()},
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
