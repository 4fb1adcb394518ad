"""What fits with a bf16, int8 or int4 base (LoRA): Open Llama 3B v2 and 7B v2 on TPU v5e-8 and v5e-1.

Plans (nothing is loaded or compiled) the shipped LoRA recipe with ``model.quantize`` none, int8
and int4 and prints the README's table; ``--json`` also writes every plan.

    python scripts/quant_fit.py --json quant_fit.json

- Open Llama 3B v2 on a v5e-8 (Kaggle): the shipped recipe as it is (32 x 1024 tokens per step, 4 per chip).
- Open Llama 7B v2 (``openlm-research/open_llama_7b_v2``'s shipped config) on a v5e-8 with the same
  recipe (4 x 1024 tokens per chip), and on one v5e chip (Colab) with 4 sequences of 1024 tokens per step.

Every point: LoRA r=16 on all seven projections, dropout 0, AdamW, activation checkpointing, FSDP,
the model's own LM head (not quantized).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem_tpu.config import load_recipe  # noqa: E402
from lowmem_tpu.config.devices import DEVICES, GiB  # noqa: E402
from lowmem_tpu.memory.advise import plan_json  # noqa: E402
from lowmem_tpu.memory.plan import plan_setting  # noqa: E402
from lowmem_tpu.memory.shape import setting_of, shape_of  # noqa: E402
from lowmem_tpu.model.loading import require_config  # noqa: E402

SEVEN_B = "openlm-research/open_llama_7b_v2"
POINTS = [  # (label, device, overrides of recipes/open_llama_lora.yaml)
    ("Open Llama 3B v2", "v5e-8", []),
    (
        "Open Llama 7B v2",
        "v5e-1",
        [f"model.name_or_path={SEVEN_B}", "train.global_batch_size=4", "runtime.num_cpu_devices=1"],
    ),
    ("Open Llama 7B v2", "v5e-8", [f"model.name_or_path={SEVEN_B}"]),
]
BASES = ("none", "int8", "int4")


def rows() -> list[dict]:
    out = []
    for label, device_name, overrides in POINTS:
        device = DEVICES[device_name]
        for base in BASES:
            recipe = load_recipe(ROOT / "recipes" / "open_llama_lora.yaml", [*overrides, f"model.quantize={base}"])
            shape = shape_of(require_config(recipe))
            st = setting_of(recipe, device.devices)
            plan = plan_setting(shape, st, "tpu", device.hbm_bytes)
            out.append(
                {
                    "model": label,
                    "device": device_name,
                    "base": "bf16" if base == "none" else f"{base} (+ bf16 scales)",
                    "tokens_per_device": f"{st.sequences} x {st.length}",
                    "group_size": st.group_size if base == "int4" else None,
                    "plan": plan_json(plan),
                    "_plan": plan,
                }
            )
    return out


def table(items: list[dict]) -> str:
    head = "| model | device | base | tokens / device | weights | dequantized | peak | needed (+ margin) | fits? |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in items:
        p = r["_plan"]
        fits = "yes" if p.fits else "no"
        lines.append(
            f"| {r['model']} | {r['device']} ({p.capacity / GiB:.2f} GiB) | {r['base']} | {r['tokens_per_device']} | "
            f"{p.weights / GiB:.2f} | {p.dequantized / GiB:.2f} | {p.peak / GiB:.2f} | {p.needed / GiB:.2f} | "
            f"{fits} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write every plan here")
    args = parser.parse_args()
    items = rows()
    print("GiB per device (TPU layout)\n")
    print(table(items))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "_plan"} for r in items], indent=2))


if __name__ == "__main__":
    main()
