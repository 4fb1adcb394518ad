"""Compile time of Open Llama 3B's depth (26 layers, narrow): unrolled layers vs ``sharding.scan_layers``.

    python benchmarks/scan_compile.py [--steps 6] [KEY=VALUE ...]

Runs ``lowmem-tpu sft`` (LoRA, FSDP over 4 CPU devices, per-layer checkpointing) twice, each in
its own process so nothing is cached in memory: once with the layers unrolled, once scanned.
Prints compile time, compile count and the per-step losses of both; writes
``outputs/scan_compile/scan_compile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

OUT = Path("outputs/scan_compile")
# Open Llama 3B v2 has 26 layers, hidden 3200, 32 heads of 100; this keeps the depth, narrows the width.
NARROW_26 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def run(scan: bool, steps: int, overrides: list[str]) -> dict:
    model_dir = OUT / "narrow-llama-26"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(NARROW_26, indent=2))
    out = OUT / ("scan" if scan else "unrolled")
    cmd = [
        sys.executable,
        "-m",
        "lowmem_tpu.cli",
        "sft",
        "recipes/tiny_lora_cpu.yaml",
        f"output_dir={out}",
        f"model.name_or_path={model_dir.resolve()}",
        "model.tokenizer=builtin:tiny-llama",
        f"train.max_steps={steps}",
        "train.logging_steps=1",
        "train.global_batch_size=16",
        "train.eval_samples=0",
        "data.eval_path=null",
        "runtime.compile_cache_dir=null",
        f"sharding.scan_layers={str(scan).lower()}",
        *overrides,
        "--overwrite",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    load = os.getloadavg()[0]  # compile time is wall time: a busy machine inflates it
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    metrics = json.loads((out / "final" / "metrics.json").read_text())
    return {
        "scan_layers": scan,
        "compile_seconds": metrics["compiles"]["seconds"],
        "compiles": metrics["compiles"]["total"],
        "losses": [round(e["loss"], 5) for e in metrics["train"]["losses"]],
        "steady_step_time": metrics["train"]["steady_step_time"],
        "load_before": round(load, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = [run(scan, args.steps, args.overrides) for scan in (False, True)]
    (OUT / "scan_compile.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| layers | compile s | graphs | steady s/step | load | losses |\n|---|---|---|---|---|---|")
    for r in rows:
        name = "scanned" if r["scan_layers"] else "unrolled"
        step = f"{r['steady_step_time']:.3f}" if r["steady_step_time"] else "n/a"
        load, losses = r["load_before"], r["losses"]
        print(f"| {name} | {r['compile_seconds']:.1f} | {r['compiles']} | {step} | {load} | {losses} |")
    print(f"\ncompile time ratio unrolled / scanned: {rows[0]['compile_seconds'] / rows[1]['compile_seconds']:.2f}")


if __name__ == "__main__":
    main()
