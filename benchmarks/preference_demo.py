"""The preference demo on the CPU backend: SFT then DPO, single-stage ORPO from the base, SFT then KTO.

    python benchmarks/preference_demo.py [--sft-steps 220] [--table]

Trains ``recipes/tiny_lora_cpu.yaml`` for ``--sft-steps`` steps (the reversal half learned); from that run's
adapter, ``recipes/tiny_dpo_cpu.yaml`` twice (the recipe's loss, TRL's sigmoid DPO loss plus the chosen
answers' NLL, RPO; and the DPO loss alone) and ``recipes/tiny_kto_cpu.yaml`` (each pair read as two unpaired
rows); from the base, ``recipes/tiny_orpo_cpu.yaml``. Every model is scored the same way on the held-out pairs
before and after (``lowmem-tpu eval --method orpo``: the share of pairs whose chosen answer has the higher
average log-probability, no reference) and by greedy exact match of the chosen answers; each run's own
figures (TRL's, by its method) are kept too. Writes ``benchmarks/results/preference_demo.json``; ``--table``
prints its markdown table from that file. About 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "preference_demo.json"
HELD_OUT = "builtin:reverse/prefer_eval.jsonl"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, check=True, capture_output=True, text=True
    )


def scored(directory: Path, method: str) -> float:
    """The held-out pairs ``method`` counts as preferred: orpo, the chosen answer likelier (no reference); dpo,
    its implied reward (beta x the log-ratio to the run's reference) above the rejected one's."""
    args = ["--data", HELD_OUT, "--format", "preference", "--method", method, "--samples", "0", "--json"]
    return json.loads(cli("eval", str(directory), *args).stdout)["preference_accuracy"]


def train(command: str, recipe: str, out: Path, *overrides: str) -> dict:
    cli(command, recipe, f"output_dir={out}", *overrides)
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    keys = ("exact_match", "preference_accuracy", "reward_margin", "loss")
    return {
        "before": {k: before[k] for k in keys if k in before},
        "after": {k: after[k] for k in keys if k in after} | {"likelier": scored(out / "final", "orpo")},
        "compiles_after_warmup": metrics["compiles"]["after_warmup"],
        "seconds": metrics["time"]["total_seconds"],
    }


def run_all(sft_steps: int, tmp: Path) -> dict:
    result: dict = {"sft_steps": sft_steps, "runs": {}}
    runs = result["runs"]
    sft = tmp / "sft"
    print(f"SFT: {sft_steps} steps...", file=sys.stderr, flush=True)
    warmup = f"train.warmup_steps={sft_steps // 10}"
    runs["SFT"] = train("sft", "recipes/tiny_lora_cpu.yaml", sft, f"train.max_steps={sft_steps}", warmup)
    runs["SFT"]["start"] = "the base"
    after_sft = {"exact_match": runs["SFT"]["after"]["exact_match"], "likelier": runs["SFT"]["after"]["likelier"]}
    start = [f"model.name_or_path={sft / 'base'}", "model.random_init=false", f"model.adapter={sft / 'final'}"]
    plan = {
        "DPO + NLL of the chosen (RPO, the recipe's)": ("dpo", "tiny_dpo_cpu", ["preference.loss_type=[sigmoid, sft]"]),
        "DPO alone": ("dpo", "tiny_dpo_cpu", ["preference.loss_type=[sigmoid]"]),
        "KTO": ("kto", "tiny_kto_cpu", []),
    }
    for index, (name, (command, recipe, extra)) in enumerate(plan.items()):
        print(f"{name}...", file=sys.stderr, flush=True)
        out = tmp / f"{command}-{index}"
        runs[name] = train(command, f"recipes/{recipe}.yaml", out, *start, *extra)
        if command == "kto":  # KTO logs no accuracy: its implied rewards against its reference, as DPO counts them
            runs[name]["after"]["preference_accuracy"] = scored(out / "final", "dpo")
        runs[name] |= {"start": "the SFT adapter", "before_scored": after_sft}
    print("ORPO from the base...", file=sys.stderr, flush=True)
    runs["ORPO"] = train("orpo", "recipes/tiny_orpo_cpu.yaml", tmp / "orpo")
    base = {
        "exact_match": runs["ORPO"]["before"]["exact_match"],
        "likelier": runs["ORPO"]["before"]["preference_accuracy"],
    }
    runs["ORPO"] |= {"start": "the base", "before_scored": base}
    return result


def table(result: dict) -> str:
    from lowmem_tpu.config import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_dpo_cpu.yaml"))
    held_out = len((ROOT / "lowmem_tpu" / "assets" / "reverse" / "prefer_eval.jsonl").read_text().splitlines())
    scored = held_out // recipe.train.global_batch_size * recipe.train.global_batch_size  # whole batches only
    lines = [
        f"`python benchmarks/preference_demo.py` on the CPU backend (4 virtual devices). Held out: the share of "
        f"{scored} pairs (the whole batches of {recipe.train.global_batch_size} of {held_out}) whose chosen answer "
        "has the higher average log-probability (`lowmem-tpu eval --method orpo`: the same measure for every "
        "method, no reference), the run's own preference accuracy (TRL's, by its method: DPO's against its "
        "reference, ORPO's likelier chosen answer; KTO logs none: its implied rewards against its reference, as "
        f"`eval --method dpo` counts them), and greedy exact match over the first {recipe.train.eval_samples} "
        "prompts. Before DPO's first step the policy is its reference: their log-ratios agree to float rounding "
        "(about 1e-8), and TRL's strict comparison counts those ties at random:",
        "",
        "| run | from | chosen likelier | own preference accuracy | exact match | compiles after warm-up | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        b, a = run["before"], run["after"]
        scored_before = run.get("before_scored")
        likely = f"{scored_before['likelier']:.3f} -> {a['likelier']:.3f}" if scored_before else f"{a['likelier']:.3f}"
        own = "n/a"
        if "preference_accuracy" in a:  # KTO's: after training only (its run logs none)
            own = f"{b['preference_accuracy']:.3f} -> " if "preference_accuracy" in b else "after: "
            own += f"{a['preference_accuracy']:.3f}"
        lines.append(
            f"| {name} | {run['start']} | {likely} | {own} | {b['exact_match']:.3f} -> {a['exact_match']:.3f} | "
            f"{run['compiles_after_warmup']} | {run['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=220)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    if not args.table:
        with tempfile.TemporaryDirectory(prefix="lowmem-preference-demo-") as tmp:
            RESULT.write_text(json.dumps(run_all(args.sft_steps, Path(tmp)), indent=2) + "\n")
    print(table(json.loads(RESULT.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
