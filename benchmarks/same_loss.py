"""Two settings of the tiny demo that must train alike: their loss curves, same data and seed, against the noise.

    python benchmarks/same_loss.py COMPARISON [--steps 50] [--table]

COMPARISON is one of:

- ``adapter-dtype``: the adapters in the base's bf16 (``lora.dtype=model``: the adapter branch computes in bf16,
  the optimizer updates fp32 master copies) against PEFT's fp32 adapters, the demo in bf16.
- ``placement``: the weights replicated on every device (``sharding.strategy=replicated``: nothing gathered)
  against FSDP (each weight split over the devices, gathered for each layer).
- ``open-llama-placement``: the same on ``recipes/open_llama_lora.yaml`` in bf16, run on the Open Llama
  stand-in and Alpaca records of ``benchmarks/rehearse_open_llama.py`` (4 CPU devices, 8 rows of 128 tokens,
  1 row per device in each of 2 micro-batches, chunked attention).

Trains each setting for ``--steps`` steps on the CPU backend, same data, seed 42; the noise
is the reference setting against itself at seed 43 (other adapters drawn, other batches). Prints the logged
losses and the largest differences; writes ``benchmarks/results/same_loss_COMPARISON.json``; ``--table`` prints
its markdown table from that file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Comparison:
    what: str  # the run as trained, for the table's sentence
    common: tuple[str, ...]  # overrides both settings share
    setting: tuple[str, str]  # (name, override) under test
    reference: tuple[str, str]  # (name, override) it must match
    recipe: str = "recipes/tiny_lora_cpu.yaml"
    stand_in: bool = False  # run on benchmarks/rehearse_open_llama.py's Open Llama stand-in


COMPARISONS = {
    "adapter-dtype": Comparison(
        "The tiny demo in bf16",
        ("model.dtype=bfloat16",),
        ("bf16 adapters, fp32 masters (lora.dtype: model)", "lora.dtype=model"),
        ("fp32 adapters (lora.dtype: float32)", "lora.dtype=float32"),
    ),
    "placement": Comparison(
        "The tiny demo on 4 virtual devices",
        (),
        ("weights replicated (sharding.strategy: replicated)", "sharding.strategy=replicated"),
        ("weights sharded, FSDP (sharding.strategy: fsdp)", "sharding.strategy=fsdp"),
    ),
    "open-llama-placement": Comparison(
        "open_llama_lora.yaml on the Open Llama stand-in (4 virtual devices, bf16)",
        ("model.attn_implementation=chunked", "data.packing=false", "train.gradient_accumulation_steps=2"),
        ("weights replicated (sharding.strategy: replicated)", "sharding.strategy=replicated"),
        ("weights sharded, FSDP (sharding.strategy: fsdp)", "sharding.strategy=fsdp"),
        recipe="recipes/open_llama_lora.yaml",
        stand_in=True,
    ),
}


def result_path(name: str) -> Path:
    return RESULTS / f"same_loss_{name.replace('-', '_')}.json"


def train(recipe: str, overrides: tuple[str, ...], steps: int, out: Path, seed: int = 42) -> list[dict]:
    command = [
        sys.executable, "-m", "lowmem_tpu.cli", "sft", recipe, *overrides,
        f"output_dir={out}", f"train.max_steps={steps}", "train.logging_steps=5", f"train.save_steps={steps * 10}",
        "train.eval_samples=0", f"train.seed={seed}",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((out / "final" / "metrics.json").read_text())["train"]["losses"]


def table(name: str, result: dict) -> str:
    names = list(result["curves"])
    lines = [
        f"{result['what']} on the CPU backend, {result['steps']} steps, seed 42 "
        f"(`python benchmarks/same_loss.py {name}`): the largest difference of the logged losses is "
        f"{result['largest_difference']:.4f} between the two, {result['seed_difference']:.4f} between the second "
        f"at seeds 42 and 43 (final losses {result['final'][names[0]]:.4f} and {result['final'][names[1]]:.4f}).",
        "",
        f"| step | {' | '.join(names)} |",
        "|---|---|---|",
    ]
    for a, b in zip(*(result["curves"][n] for n in names), strict=True):
        lines.append(f"| {a['step']} | {a['loss']:.4f} | {b['loss']:.4f} |")
    return "\n".join(lines)


def compare(name: str, steps: int) -> dict:
    comparison = COMPARISONS[name]
    common = comparison.common
    if comparison.stand_in:
        from rehearse_open_llama import stand_in  # benchmarks/, beside this script

        common = (*stand_in(), "train.resume=never", *common)
    curves = {}
    with tempfile.TemporaryDirectory(prefix="lowmem-same-loss-") as tmp:
        for index, (label, override) in enumerate((comparison.setting, comparison.reference)):
            print(f"training: {label}...", file=sys.stderr, flush=True)
            curves[label] = train(comparison.recipe, (*common, override), steps, Path(tmp) / str(index))
        print(f"training: {comparison.reference[0]} at seed 43 (the noise)...", file=sys.stderr, flush=True)
        noise = (*common, comparison.reference[1])
        other_seed = train(comparison.recipe, noise, steps, Path(tmp) / "seed43", seed=43)
    a, b = curves.values()
    return {
        "what": comparison.what,
        "steps": steps,
        "curves": curves,
        "largest_difference": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)),
        "seed_difference": max(abs(x["loss"] - y["loss"]) for x, y in zip(b, other_seed, strict=True)),
        "final": {label: curve[-1]["loss"] for label, curve in curves.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("comparison", choices=sorted(COMPARISONS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    path = result_path(args.comparison)
    if args.table:
        print(table(args.comparison, json.loads(path.read_text())))
        return 0
    result = compare(args.comparison, args.steps)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(args.comparison, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
