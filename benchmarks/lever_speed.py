"""Step time of each memory lever against the plain step: ``lowmem-tpu sft`` itself, alternating.

    python benchmarks/lever_speed.py [--rounds 2] [--steps 6] [--length 128]

The model is ``memory_levers.py``'s ``mini`` (benchmarks/mini_llama.json: Open Llama's proportions, 4 layers
of hidden 400, vocabulary 32000, random init) on 4 CPU devices, LoRA, fp32, 16 sequences of ``--length`` tokens
per step. Each round runs every lever once, in order; a lever's figure is the median over rounds
of its steady step time divided by the plain step's in the same round. Writes
``outputs/lever_speed/lever_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# memory_levers.py's ``mini``: Open Llama's proportions at 4 layers of hidden 400, vocabulary 32000.
MINI = json.loads((Path(__file__).resolve().parent / "mini_llama.json").read_text())
OUT = ROOT / "outputs/lever_speed"
LEVERS = {
    "plain (checkpointing on)": [],
    "checkpointing off": ["sharding.activation_checkpointing=false"],
    "checkpointing one layer in two": ["sharding.activation_checkpointing=every_2"],
    "accumulation 4": ["train.gradient_accumulation_steps=4"],
    "chunked loss": ["train.chunked_loss=true"],
    "TRL's fused head": ["train.fused_lm_head=true"],
    "chunked attention": ["model.attn_implementation=chunked"],
    "packing (eager, block mask)": ["data.packing=true"],
}


def step_time(model_dir: Path, length: int, steps: int, overrides: list[str], name: str) -> float:
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.run import run_training

    recipe = load_recipe(
        ROOT / "recipes/tiny_lora_cpu.yaml",
        [
            f"output_dir={OUT / name}",
            f"model.name_or_path={model_dir}",
            "model.tokenizer=builtin:tiny-llama",
            f"data.max_length={length}",
            "train.global_batch_size=16",
            f"train.max_steps={steps}",
            f"train.logging_steps={steps // 3}",
            "train.eval_samples=0",
            "data.eval_path=null",
            *overrides,
        ],
    )
    return run_training(recipe, overwrite=True).metrics["train"]["steady_step_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp(prefix="lowmem-mini-"))
    (model_dir / "config.json").write_text(json.dumps(MINI))
    times: dict[str, list[float]] = {name: [] for name in LEVERS}
    for round_ in range(args.rounds):
        for name, overrides in LEVERS.items():
            times[name].append(step_time(model_dir, args.length, args.steps, overrides, "run"))
            print(f"round {round_ + 1}: {name}: {times[name][-1]:.3f} s/step", flush=True)
    plain = times["plain (checkpointing on)"]
    ratios = {name: statistics.median(t / p for t, p in zip(ts, plain, strict=True)) for name, ts in times.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "step_time": times, "median_ratio_to_plain": ratios}
    (OUT / "lever_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n| lever | step time (median of {args.rounds} rounds) | against plain |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1000:.0f} ms | {ratios[name]:.2f}x |")


if __name__ == "__main__":
    main()
