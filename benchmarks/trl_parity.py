"""How far each preference loss on the devices lands from TRL's own trainer, on the same rows.

    python benchmarks/trl_parity.py [--table]

For each case the tests check (tests/e2e/test_dpo.py, test_preference_methods.py): one step of the XLA trainer
(4 virtual CPU devices, FSDP, static shapes) and TRL's DPOTrainer, ORPOTrainer, CPOTrainer or KTOTrainer on
plain CPU PyTorch, the policy a tiny Llama with random LoRA adapters. Records the largest difference of the
loss, of any figure TRL logs, and of any adapter gradient (beside the largest gradient), in
``benchmarks/results/trl_parity.json``; ``--table`` prints the markdown table. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the steps the tests compare
RESULT = ROOT / "benchmarks" / "results" / "trl_parity.json"

# name -> (method, losses, options, KTO's rows)
CASES = {
    "DPO: all 15 losses summed, label smoothing 0.1": ("dpo", None, {"label_smoothing": 0.1}, None),
    "DPO: sigmoid + sft (RPO) weighted 1 and 0.3, JS f-divergence": (
        "dpo",
        "sigmoid,sft",
        {"loss_weights": [1.0, 0.3], "f_divergence_type": "js_divergence"},
        None,
    ),
    "DPO: sigmoid, alpha f-divergence 0.3, WPO, LD-DPO 0.5": (
        "dpo",
        "sigmoid",
        {
            "f_divergence_type": "alpha_divergence",
            "f_alpha_divergence_coef": 0.3,
            "use_weighting": True,
            "ld_alpha": 0.5,
        },
        None,
    ),
    "ORPO": ("orpo", "sigmoid", {}, None),
    "CPO: hinge, AlphaPO 0.2": ("cpo", "hinge", {"alphapo_alpha": 0.2}, None),
    "SimPO: gamma 0.3, label smoothing 0.1": ("simpo", "sigmoid", {"simpo_gamma": 0.3, "label_smoothing": 0.1}, None),
    "KTO: 3 desirable, 5 undesirable rows, desirable weight 1.5": (
        "kto",
        "sigmoid",
        {"desirable_weight": 1.5},
        [0, 1, 2, 8, 9, 10, 11, 12],
    ),
    "KTO: every row desirable": ("kto", "sigmoid", {}, list(range(8))),
    "KTO apo_zero_unpaired: every row undesirable, weight 0.7": (
        "kto",
        "sigmoid",
        {"undesirable_weight": 0.7, "kto_loss": "apo_zero_unpaired"},
        list(range(8, 16)),
    ),
}
BETA = 0.5


def compare(name: str, tmp: Path, base: Path, adapter: Path) -> dict:
    from preference_steps import trl_dpo_on_the_cpu, trl_on_given_rows, xla_step
    from safetensors.torch import load_file

    from lowmem_tpu.config.preference_fields import DPO_LOSSES

    method, losses, options, picks = CASES[name]
    losses = losses or ",".join(DPO_LOSSES)
    out = tmp / name.split(":")[0].replace(" ", "_").lower() / str(len(list(tmp.iterdir())))
    ours = xla_step(base, adapter, 8, BETA, losses, out / "run", options=options, method=method, picks=picks)
    if method == "dpo":
        trl = trl_dpo_on_the_cpu(base, adapter, 8, BETA, losses, out / "trl.json", options=options)
    else:
        renamed = {{"kto_loss": "loss_type"}.get(k, k.removeprefix("alphapo_")): v for k, v in options.items()}
        renamed |= {"beta": BETA} | ({"loss_type": losses} if method == "cpo" else {})
        trl = trl_on_given_rows(method, base, adapter, out / "run" / "rows.safetensors", renamed, out / "trl.json")
    figures = [key for key in trl if key != "loss" and key in ours]
    grads = load_file(str(out / "trl.json.grads.safetensors"))
    return {
        "loss": trl["loss"],
        "loss_difference": abs(ours["loss"] - trl["loss"]),
        "figures": len(figures),
        "figure_difference": max(abs(ours[k] - trl[k]) for k in figures),
        "gradients": len(grads),
        "gradient_difference": max((ours["grads"][n] - g).abs().max().item() for n, g in grads.items()),
        "largest_gradient": max(g.abs().max().item() for g in grads.values()),
    }


def table(result: dict) -> str:
    lines = [
        "`python benchmarks/trl_parity.py`: one step on 4 CPU XLA devices against TRL's trainer on plain CPU "
        f"PyTorch, the same rows (8 pairs, or 8 KTO rows), beta {BETA}; the largest difference of each:",
        "",
        "| case | loss | loss difference | figures TRL logs | largest figure difference | gradients | "
        "largest gradient difference (largest gradient) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result.items():
        lines.append(
            f"| {name} | {r['loss']:.4f} | {r['loss_difference']:.1e} | {r['figures']} | "
            f"{r['figure_difference']:.1e} | {r['gradients']} | {r['gradient_difference']:.1e} "
            f"({r['largest_gradient']:.2f}) |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    if not args.table:
        from tiny_models import make_adapter, make_base

        result = {}
        with tempfile.TemporaryDirectory(prefix="lowmem-trl-parity-") as tmp:
            base = make_base(Path(tmp) / "base")
            adapter = make_adapter(base, Path(tmp) / "adapter", r=4)
            for name in CASES:
                print(f"{name}...", file=sys.stderr, flush=True)
                result[name] = compare(name, Path(tmp), base, adapter)
        RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(json.loads(RESULT.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
