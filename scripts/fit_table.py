"""The README's fit table: what fits one TPU, planned per device by ``lowmem-tpu memory``.

    python scripts/fit_table.py [--json fit.json]

Each row is a shipped recipe with overrides, planned for its ``runtime.target`` (nothing is
downloaded: the configs ship with the project) without and with the levers that cost no accuracy
(flash attention, the TPU's own kernel, and the chunked loss); when a plan does not fit, the overrides of the
planner's next-step chain, up to the one that makes it fit, are shown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem_tpu.config import load_recipe  # noqa: E402
from lowmem_tpu.memory.advise import plan_recipe  # noqa: E402
from lowmem_tpu.model.loading import require_config  # noqa: E402

LEVERS = ["model.attn_implementation=flash", "train.chunked_loss=true"]
ROWS = {  # name -> (recipe, overrides)
    "Open Llama 3B, LoRA, 4 x 2048 tokens": ("open_llama_lora_v5e1.yaml", ["data.max_length=2048"]),
    "Open Llama 3B, LoRA, 4 x 4096 tokens": ("open_llama_lora_v5e1.yaml", ["data.max_length=4096"]),
    "Open Llama 7B, QLoRA int4, 4 x 2048 tokens": ("open_llama_7b_qlora.yaml", ["data.max_length=2048"]),
    "Llama 2 70B shape, QLoRA int4, 8 x 512 tokens": ("llama2_70b_qlora_v5e8.yaml", []),
}


def plan(recipe: str, overrides: list[str]) -> dict:
    loaded = load_recipe(ROOT / "recipes" / recipe, [*overrides, "runtime.device=tpu"])
    report = plan_recipe(loaded, loaded.runtime.target, require_config(loaded))
    p = report.plan
    fit = next((i for i, s in enumerate(report.steps) if s.plan.fits), None)
    chain = None if fit is None else report.steps[: fit + 1]
    return {
        "device": report.device.name,
        "needed_gib": p.needed / 2**30,
        "capacity_gib": p.capacity / 2**30,
        "fits": p.fits,
        "then": None
        if chain is None
        else {"overrides": [s.override for s in chain], "needed_gib": chain[-1].plan.needed / 2**30},
    }


def cell(row: dict) -> str:
    verdict = "fits" if row["fits"] else "does not fit"
    text = f"{row['needed_gib']:.1f} GiB: {verdict}"
    if not row["fits"] and row["then"]:
        text += f"; with `{' '.join(row['then']['overrides'])}`: {row['then']['needed_gib']:.1f} GiB"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    print("| model and step | TPU | as shipped | + flash attention and chunked loss |\n|---|---|---|---|")
    for name, (recipe, overrides) in ROWS.items():
        shipped = set(LEVERS) <= set(overrides) or recipe.startswith("llama2_70b")  # the 70B recipe has them on
        plain, levers = plan(recipe, overrides), plan(recipe, [*overrides, *LEVERS])
        rows.append({"name": name, "recipe": recipe, "overrides": overrides, "plain": plain, "levers": levers})
        first = "(levers on)" if shipped else cell(plain)
        print(f"| {name} (`{recipe}`) | {plain['device']} | {first} | {cell(levers)} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
