"""What a decoder layer costs the TPU compiler per chip: one recipe compiled at 2 and 4 layers, the difference.

    .venv/bin/python benchmarks/tpu_layer_slopes.py NAME RECIPE DEVICE [OVERRIDE ...] [--keep DIR]
                                                   [--json benchmarks/results/tpu_layer_slopes.json]

e.g. ``q70b recipes/llama2_70b_qlora_v5e8.yaml v5e-8`` or ``q3b recipes/open_llama_lora.yaml v5e-8
model.quantize=int4``. The step is traced with placeholders and compiled by libtpu (``lowmem-tpu memory
--compile``) at 2 and 4 decoder layers (2-3 minutes for a 70B-wide layer here); half the difference is
one layer's arguments and temporaries per chip. The temporaries are also given in hidden-sized tensors
per token (the unit of the planner's ``KEPT_PER_LAYER`` and ``QUANTIZED_KEPT_PER_LAYER``, beside them),
and so are the windowed einsums' output buffers (``AllocateBuffer``) live at the compiler's peak. With
``--keep DIR`` the dumps stay under ``DIR/NAME-N`` and a point already there is read, not compiled again.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.measure.buffers import live_at_peak, optimized_hlo
from lowmem_tpu.measure.tpu_compile import buffer_assignment, compile_recipe, compile_target
from lowmem_tpu.measure.tpu_layers import cut
from lowmem_tpu.memory.shape import setting_of, shape_of
from lowmem_tpu.memory.tpu_layout import dequantized, kept
from lowmem_tpu.model.build import require_config

LAYERS = (2, 4)
MIB = 2**20


def point(recipe_path: str, overrides: list[str], device_name: str, layers: int, work: Path) -> dict:
    """One compile's figures per chip, and the bytes of windowed einsum outputs live at its peak."""
    saved = work / "figures.json"
    if saved.exists():
        return json.loads(saved.read_text())
    work.mkdir(parents=True, exist_ok=True)
    recipe = cut(load_recipe(recipe_path, overrides), layers, work)
    result = compile_recipe(recipe, compile_target(device_name), keep=work)
    if not result.needed:
        raise SystemExit(f"{work.name}: the compiler gave no figures ({result.refused or result.error})")
    dump = buffer_assignment(work / "tpu")
    hlo = optimized_hlo(dump).read_text()
    windowed = set(re.findall(r"%(custom-call\.\d+) = [^\n]*AllocateBuffer", hlo))
    figures = {
        "arguments": result.arguments,
        "temporaries": result.temporaries,
        "needed": result.needed,
        "windowed_outputs_at_peak": sum(b for name, _, b in live_at_peak(dump) if name in windowed),
        "seconds": round(result.trace_seconds + result.compile_seconds, 1),
    }
    saved.write_text(json.dumps(figures))
    return figures


def slopes(name: str, recipe_path: str, device_name: str, overrides: list[str], keep: Path) -> dict:
    points = {n: point(recipe_path, overrides, device_name, n, keep / f"{name}-{n}") for n in LAYERS}
    recipe = load_recipe(recipe_path, [*overrides, "runtime.device=tpu"])
    shape, setting = shape_of(require_config(recipe)), setting_of(recipe, DEVICES[device_name].devices)
    per_layer = {k: (points[4][k] - points[2][k]) / (LAYERS[1] - LAYERS[0]) for k in points[2] if k != "seconds"}
    hidden = setting.tokens * shape.hidden * 2  # one hidden-sized bf16 tensor per token of the chip
    return {
        "recipe": recipe_path,
        "device": device_name,
        "overrides": overrides,
        "tokens_per_chip": setting.tokens,
        "hidden": shape.hidden,
        "per_layer_bytes": per_layer,
        "temporaries_per_token": round(per_layer["temporaries"] / hidden, 2),
        "windowed_outputs_per_token": round(per_layer["windowed_outputs_at_peak"] / hidden, 2),
        "planned_kept_per_token": round(kept(shape, setting, setting.checkpointing) / shape.layers / hidden, 2),
        "planned_quantized_per_token": round(dequantized(shape, setting) / shape.layers / hidden, 2),
        "points": points,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("recipe")
    parser.add_argument("device")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lowmem-tpu-slopes-") as tmp:
        row = slopes(args.name, args.recipe, args.device, args.overrides, args.keep or Path(tmp))
    b = row["per_layer_bytes"]
    print(
        f"{args.name} on {args.device}, {row['tokens_per_chip']} tokens per chip, per layer: arguments "
        f"{b['arguments'] / MIB:.1f} MiB, temporaries {b['temporaries'] / MIB:.1f} MiB = "
        f"{row['temporaries_per_token']} hidden-sized per token (windowed outputs {row['windowed_outputs_per_token']}; "
        f"planned {row['planned_kept_per_token']} kept + {row['planned_quantized_per_token']} quantized)"
    )
    if args.json:
        recorded = json.loads(args.json.read_text()) if args.json.exists() else {}
        args.json.write_text(json.dumps(recorded | {args.name: row}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
