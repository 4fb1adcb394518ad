"""The preference demo, as the usual pipeline: a short SFT, then DPO from its adapter, on the CPU backend.

    python benchmarks/dpo_demo.py [--sft-steps 220] [--table]

Trains ``recipes/tiny_lora_cpu.yaml`` for ``--sft-steps`` steps (the reversal half learned), then
``recipes/tiny_dpo_cpu.yaml`` from that run's adapter twice: with the recipe's loss (TRL's sigmoid DPO loss
plus the chosen answers' NLL, RPO) and with the DPO loss alone. Each run scores the held-out pairs before and
after training (TRL's preference accuracy: the chosen answer's reward above the rejected one's) and greedy
exact match of the chosen answers. Writes ``benchmarks/results/dpo_demo.json``; ``--table`` prints its
markdown table from that file. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "dpo_demo.json"
LOSSES = {"DPO + NLL of the chosen (RPO, the recipe's)": "[sigmoid, sft]", "DPO alone": "[sigmoid]"}


def run(command: str, recipe: str, out: Path, *overrides: str) -> dict:
    cli = [sys.executable, "-m", "lowmem_tpu.cli", command, recipe, f"output_dir={out}", *overrides]
    subprocess.run(cli, cwd=ROOT, check=True, capture_output=True, text=True)
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    keys = ("exact_match", "preference_accuracy", "reward_margin", "loss")
    return {
        "before": {k: before[k] for k in keys if k in before},
        "after": {k: after[k] for k in keys if k in after},
        "compiles_after_warmup": metrics["compiles"]["after_warmup"],
        "seconds": metrics["time"]["total_seconds"],
    }


def table(result: dict) -> str:
    from lowmem_tpu.config import load_recipe

    sft = result["sft"]
    recipe = load_recipe(str(ROOT / "recipes" / "tiny_dpo_cpu.yaml"))
    held_out = len((ROOT / "lowmem_tpu" / "assets" / "reverse" / "prefer_eval.jsonl").read_text().splitlines())
    scored = held_out // recipe.train.global_batch_size * recipe.train.global_batch_size  # whole batches only
    lines = [
        f"`python benchmarks/dpo_demo.py` on the CPU backend (4 virtual devices): {result['sft_steps']} SFT steps "
        f"take held-out exact match from {sft['before']['exact_match']:.2f} to {sft['after']['exact_match']:.2f}; "
        f"DPO then starts from that adapter ({result['dpo_steps']} steps, beta {result['beta']}, the reference "
        f"a frozen copy of the SFT adapter). Held out: preference accuracy and margin over {scored} pairs (the "
        f"whole batches of {recipe.train.global_batch_size} of {held_out}), exact match over the first "
        f"{recipe.train.eval_samples} prompts:",
        "",
        "| run | preference accuracy | reward margin | exact match | compiles after warm-up | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in result["dpo"].items():
        b, a = runs["before"], runs["after"]
        lines.append(
            f"| {name} | {b['preference_accuracy']:.3f} -> {a['preference_accuracy']:.3f} | "
            f"{b['reward_margin']:.3f} -> {a['reward_margin']:.3f} | {b['exact_match']:.3f} -> "
            f"{a['exact_match']:.3f} | {runs['compiles_after_warmup']} | {runs['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=220)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return 0
    from lowmem_tpu.config import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_dpo_cpu.yaml"))
    result = {"sft_steps": args.sft_steps, "dpo_steps": recipe.train.max_steps, "beta": recipe.preference.beta}
    with tempfile.TemporaryDirectory(prefix="lowmem-dpo-demo-") as tmp:
        sft = Path(tmp) / "sft"
        print(f"SFT: {args.sft_steps} steps...", file=sys.stderr, flush=True)
        warmup = f"train.warmup_steps={args.sft_steps // 10}"
        result["sft"] = run("sft", "recipes/tiny_lora_cpu.yaml", sft, f"train.max_steps={args.sft_steps}", warmup)
        start = [f"model.name_or_path={sft / 'base'}", "model.random_init=false", f"model.adapter={sft / 'final'}"]
        result["dpo"] = {}
        for name, losses in LOSSES.items():
            print(f"DPO: {name}...", file=sys.stderr, flush=True)
            out = Path(tmp) / f"dpo-{len(result['dpo'])}"
            result["dpo"][name] = run("dpo", "recipes/tiny_dpo_cpu.yaml", out, *start, f"preference.loss_type={losses}")
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
