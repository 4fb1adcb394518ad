"""The Open Llama path on the CPU, end to end, with the figures that say it is right.

    python benchmarks/rehearse_open_llama.py [--steps 10]

Builds an Open-Llama-shaped directory (``python tests/helpers/open_llama_like.py DIR``, the test suite's
stand-in, run as a command: the Hub's file set, a 400-piece sentencepiece tokenizer, bf16 weights in
pytorch_model.bin) and a small Alpaca file (``ALPACA``: tests/helpers/open_llama_data.py's records), then runs
the shipped recipes on it with local overrides: ``open_llama_lora.yaml``, and
``open_llama_full.yaml`` with AdamW at lr 2e-5 (constant) in bf16 with and without fp32 master
weights and in fp32. Prints the first losses, the fraction of weights each full run moved, and the
bf16-vs-fp32 loss gap; writes ``outputs/rehearse_open_llama/rehearsal.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "rehearse_open_llama"
# The local overrides of tests/e2e/test_open_llama.py (4 CPU devices, batch 8 x 128, a log every step, no
# saves) but its chunked attention, which the LoRA run names (flash is the recipe's TPU kernel): the
# rehearsal's figures in docs/cpu.md use these.
STEPS = [
    "runtime.device=cpu",
    "runtime.num_cpu_devices=4",
    "data.max_length=128",
    "train.global_batch_size=8",
    "train.logging_steps=1",
    "train.warmup_steps=0",
    "train.save_steps=null",
    "train.max_wall_time=null",
    "runtime.compile_cache_dir=null",
]


def stand_in() -> list[str]:
    """The overrides that run an Open Llama recipe on the stand-in and the Alpaca records (built once)."""
    import subprocess

    OUT.mkdir(parents=True, exist_ok=True)
    model = OUT / "open_llama_like"
    if not (model / "tokenizer.model").exists():  # the test suite's stand-in, run as a command
        subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "open_llama_like.py"), str(model)], check=True)
    data = OUT / "alpaca.json"  # the test suite's records, written by their command
    subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "open_llama_data.py"), str(data)], check=True)
    return [f"model.name_or_path={model}", f"data.path={data}", *STEPS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.run import run_training

    model = OUT / "open_llama_like"
    local = [*stand_in(), f"train.max_steps={args.steps}"]
    local.append("train.resume=never")
    full = ["train.optimizer=adamw", "train.learning_rate=2e-5", "train.lr_scheduler=constant"]
    full += ["model.attn_implementation=eager", "data.packing=false", "train.gradient_accumulation_steps=1"]
    full += ["sharding.activation_checkpointing=true"]  # the TPU-tuned speed settings left out on the CPU
    lora = ["model.attn_implementation=chunked", "data.packing=false", "train.gradient_accumulation_steps=2"]
    runs = {
        "lora": ("recipes/open_llama_lora.yaml", lora),
        "full bf16, master weights": ("recipes/open_llama_full.yaml", full),
        "full bf16, no master weights": ("recipes/open_llama_full.yaml", [*full, "train.master_weights=false"]),
        "full fp32": ("recipes/open_llama_full.yaml", [*full, "model.dtype=float32"]),
    }
    before = torch.load(model / "pytorch_model.bin", weights_only=True)
    results = {}
    for name, (recipe, extra) in runs.items():
        out = OUT / name.replace(" ", "_").replace(",", "")
        run = run_training(load_recipe(recipe, [f"output_dir={out}", *local, *extra]), overwrite=True)
        losses = [e["loss"] for e in run.metrics["train"]["losses"]]
        entry = {"first_loss": losses[0], "last_loss": losses[-1], "losses": losses}
        if name.startswith("full"):
            after = load_file(str(run.final_dir / "model.safetensors"))
            moved = {k: (after[k].to(before[k].dtype) != before[k]) for k in after}
            norms = [k for k in after if "norm" in k]
            entry["moved_fraction"] = sum(int(m.sum()) for m in moved.values()) / sum(m.numel() for m in moved.values())
            entry["norm_weights_moved"] = f"{sum(bool(moved[k].any()) for k in norms)} of {len(norms)}"
        results[name] = entry
    bf16, fp32 = results["full bf16, master weights"]["losses"], results["full fp32"]["losses"]
    gap = max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True))
    summary = {"ln_vocab": math.log(400), "runs": results, "max_relative_loss_gap_bf16_vs_fp32": gap}
    (OUT / "rehearsal.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nln(400) = {math.log(400):.3f}")
    for name, entry in results.items():
        moved = f", moved {entry['moved_fraction']:.1%}" if "moved_fraction" in entry else ""
        norms = f", norm weights moved {entry['norm_weights_moved']}" if "norm_weights_moved" in entry else ""
        print(f"{name:<30} first loss {entry['first_loss']:.4f}, last {entry['last_loss']:.4f}{moved}{norms}")
    print(f"bf16 (master weights) vs fp32 losses: at most {gap:.3%} apart over {len(bf16)} steps")


if __name__ == "__main__":
    main()
