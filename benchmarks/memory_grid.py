"""The planner's accuracy grid: planned vs the CPU compiler's per-device peak, fp32.

Two models (the shipped tiny Llama, and a 162M Llama: hidden 768, 12 layers, intermediate 3072,
vocab 32000), LoRA and full fine-tuning, 1/2/4/8 devices, activation checkpointing on and off.
Each point compiles the real training step of ``recipes/tiny_lora_cpu.yaml`` (with overrides) in
its own subprocess and compares the planner (CPU-backend layout) with XLA's buffer assignment.

    python benchmarks/memory_grid.py                      # the whole grid, ~20 min on 2 cores
    python benchmarks/memory_grid.py --models tiny --devices 4 --json grid.json
    python benchmarks/memory_grid.py --replan grid.json   # the planner again on rows measured before
    python benchmarks/memory_grid.py --models tiny,m512 --modes lora --quantize none,int8,int4 --devices 1,4

``--quantize`` (LoRA points only) freezes the base in int8 or int4 (``model.quantize``); ``m512`` is a
small Llama whose weights are a large share of the peak (hidden 512, 4 layers, 4 x 256 tokens per
device), where a quantized base's transient shows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.measure.local import compile_step
from lowmem_tpu.memory.advise import plan_recipe
from lowmem_tpu.model.build import require_config

ROOT = Path(__file__).resolve().parents[1]

LLAMA_162M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA_M512 = LLAMA_162M | {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 1000,
}
# The 162M model runs shorter batches than a real run would (8 x 512 tokens over all devices),
# still enough tokens that XLA shards activations by batch, as in real runs (see docs/memory.md).
MODELS = {
    "tiny": ["model.dtype=float32"],  # the recipe's own: 64 x 24 tokens
    "162m": ["model.dtype=float32", "data.max_length=512", "train.global_batch_size=8"],
    "m512": ["model.dtype=float32", "data.max_length=256"],  # 4 x 256 tokens per device
}
CONFIGS = {"162m": LLAMA_162M, "m512": LLAMA_M512}


def _batch(model: str, devices: int) -> list[str]:
    return [f"train.global_batch_size={4 * devices}"] if model == "m512" else []


def grid_points(
    models: list[str], devices: list[int], modes: list[str], quantize: list[str]
) -> list[tuple[str, str, bool, int, str]]:
    return [
        (m, mode, ckpt, d, q)
        for m in models
        for mode in modes
        for q in (quantize if mode == "lora" else ["none"])
        for ckpt in (True, False)
        for d in devices
    ]


def point_recipe(model: str, mode: str, ckpt: bool, devices: int, model_dir: Path, quantize: str = "none"):
    """The tiny recipe with this point's overrides."""
    overrides = [*MODELS[model], *_batch(model, devices), f"lora.enabled={str(mode == 'lora').lower()}"]
    overrides.append(f"sharding.activation_checkpointing={str(ckpt).lower()}")
    overrides.append(f"runtime.num_cpu_devices={devices}")
    overrides.append(f"model.quantize={quantize}")
    if model in CONFIGS:
        overrides.append(f"model.name_or_path={model_dir / model}")
    return load_recipe(ROOT / "recipes" / "tiny_lora_cpu.yaml", overrides)


def plan_point(row: dict, model_dir: Path) -> dict:
    """Add the planner's figures (CPU-backend layout) and the errors to a measured row."""
    quantize = row.get("quantize", "none")
    recipe = point_recipe(row["model"], row["mode"], row["checkpointing"], row["devices"], model_dir, quantize)
    plan = plan_recipe(recipe, "cpu", require_config(recipe)).plan
    return row | {
        "quantize": quantize,
        "planned_peak": plan.peak,
        "peak_error": plan.peak / row["measured_peak"] - 1,
        "planned_persistent": plan.persistent,
        "persistent_error": plan.persistent / row["measured_persistent"] - 1,
    }


def measure_point(
    model: str, mode: str, ckpt: bool, devices: int, quantize: str, model_dir: Path, steady: bool
) -> dict:
    """Compile one point (in a subprocess) and plan it."""
    started = time.perf_counter()
    m = compile_step(point_recipe(model, mode, ckpt, devices, model_dir, quantize), devices, steady=steady)
    row = {
        "model": model,
        "mode": mode,
        "quantize": quantize,
        "checkpointing": ckpt,
        "devices": devices,
        "step": m.step,
        "measured_peak": m.compiler.total_bytes,
        "measured_persistent": m.state.weights + m.state.gradients + m.state.optimizer,
        "compile_seconds": m.compile_seconds,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return plan_point(row, model_dir)


def table(rows: list[dict]) -> str:
    """The grid as a Markdown table (MiB per device)."""
    head = "| model | mode | ckpt | devices | compiler peak MiB | planned MiB | error | persistent error |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = r["mode"] if r.get("quantize", "none") == "none" else f"{r['mode']}, {r['quantize']}"
        lines.append(
            f"| {r['model']} | {mode} | {'on' if r['checkpointing'] else 'off'} | {r['devices']} | "
            f"{r['measured_peak'] / 2**20:,.1f} | {r['planned_peak'] / 2**20:,.1f} | {100 * r['peak_error']:+.1f}% | "
            f"{100 * r['persistent_error']:+.2f}% |"
        )
    worst = max(abs(r["peak_error"]) for r in rows)
    worst_state = max(abs(r["persistent_error"]) for r in rows)
    lines.append(f"\nworst peak error {100 * worst:.1f}%, worst persistent-state error {100 * worst_state:.2f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,162m", help="comma-separated: tiny, 162m, m512")
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--quantize", default="none", help="comma-separated bases for LoRA points: none, int8, int4")
    parser.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    parser.add_argument("--steady", action="store_true", help="run one real step first, compile the second")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--replan", type=Path, nargs="+", help="re-plan rows measured before (their --json files)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="llama-configs-") as tmp:
        for name, config in CONFIGS.items():
            (Path(tmp) / name).mkdir()
            (Path(tmp) / name / "config.json").write_text(json.dumps(config))
        if args.replan:
            rows = [plan_point(row, Path(tmp)) for path in args.replan for row in json.loads(path.read_text())]
        for point in (
            []
            if args.replan
            else grid_points(
                args.models.split(","),
                [int(d) for d in args.devices.split(",")],
                args.modes.split(","),
                args.quantize.split(","),
            )
        ):
            row = measure_point(*point, model_dir=Path(tmp), steady=args.steady)
            rows.append(row)
            print(
                f"{row['model']:>5} {row['mode']:>4} {row['quantize']:>4} ckpt={row['checkpointing']!s:5} "
                f"d={row['devices']} "
                f"compiler {row['measured_peak'] / 2**20:9.1f} MiB  planned {row['planned_peak'] / 2**20:9.1f} MiB  "
                f"{100 * row['peak_error']:+6.1f}%  ({row['seconds']} s)",
                flush=True,
            )
    print("\n" + table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
