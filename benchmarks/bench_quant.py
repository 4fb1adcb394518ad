"""Step time of LoRA on an int8 / int4 base against the unquantized base, same CPU devices, one process.

    python benchmarks/bench_quant.py [--steps 60] [--rounds 2] [--hidden 512] [KEY=VALUE ...]

Runs ``lowmem-tpu sft`` (``run_training``) on a 4-layer Llama of the given width (random init, the
shipped character tokenizer) with ``model.quantize`` none, int8 and int4, alternating the order
each round so a busy machine penalises every variant alike. Reports the steady step time (mean
over the log intervals after warm-up), its ratio to the unquantized base, and the final loss;
writes ``outputs/bench_quant/bench_quant.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

OUT = Path("outputs/bench_quant")
METHODS = ("none", "int8", "int4")


def model_dir(hidden: int) -> Path:
    """A Llama config of the given width (Open Llama's proportions), 4 layers, the tiny vocabulary."""
    path = OUT / f"llama-{hidden}"
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 48,
        "hidden_size": hidden,
        "intermediate_size": hidden * 27 // 10 // 64 * 64,
        "num_hidden_layers": 4,
        "num_attention_heads": max(hidden // 64, 1),
        "num_key_value_heads": max(hidden // 64, 1),
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def run(method: str, steps: int, hidden: int, overrides: list[str]) -> dict:
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.run import run_training

    recipe = load_recipe(
        "recipes/tiny_lora_cpu.yaml",
        [
            f"output_dir={OUT / method}",
            f"model.name_or_path={model_dir(hidden).resolve()}",
            "model.tokenizer=builtin:tiny-llama",
            f"model.quantize={method}",
            f"train.max_steps={steps}",
            f"train.logging_steps={steps // 4}",
            "train.eval_samples=0",
            "data.eval_path=null",
            "runtime.compile_cache_dir=null",
            *overrides,
        ],
    )
    metrics = run_training(recipe, overwrite=True).metrics
    return {"step_time": metrics["train"]["steady_step_time"], "final_loss": metrics["train"]["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.xla.runtime import configure_environment

    configure_environment(load_recipe("recipes/tiny_lora_cpu.yaml").runtime)
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        order = METHODS[r % 3 :] + METHODS[: r % 3]
        for method in order:
            results[method].append(run(method, args.steps, args.hidden, args.overrides))
            print(f"round {r + 1}: {method} {results[method][-1]}", flush=True)
    base = statistics.median(x["step_time"] for x in results["none"])
    rows = []
    for method in METHODS:
        step = statistics.median(x["step_time"] for x in results[method])
        rows.append({"quantize": method, "step_time": step, "ratio": step / base, "runs": results[method]})
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, 4 XLA CPU devices"
    (OUT / "bench_quant.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nhidden {args.hidden}, {args.steps} steps x {args.rounds} rounds on {machine}")
    print("| base | steady s/step | vs unquantized | final loss |\n|---|---|---|---|")
    for row in rows:
        loss = statistics.mean(x["final_loss"] for x in row["runs"])
        print(f"| {row['quantize']} | {row['step_time']:.3f} | {row['ratio']:.2f}x | {loss:.4f} |")


if __name__ == "__main__":
    main()
