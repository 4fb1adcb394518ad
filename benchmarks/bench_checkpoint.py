"""What checkpointing costs: time per save and whole-run time with and without ``train.save_steps``.

    python benchmarks/bench_checkpoint.py [--steps 16] [--models demo,m100] [--modes lora,full]

Each point runs the real ``lowmem-tpu sft`` in this process on 4 CPU XLA devices: an 8-step warm-up
run (so that neither measured run pays for compiling), then once without saves and once saving every
4 steps (logging every 5, so saves land between logs). ``demo``
is the embedded tiny Llama; ``m100`` a ~110 M-parameter Llama (hidden 768, 12 layers, vocabulary
16k) built from a config with random weights. Results print as a table and go to
``outputs/bench_checkpoint/bench_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

OUT = Path("outputs/bench_checkpoint")
M100 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 512,
    "vocab_size": 16384,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}


def model_overrides(name: str) -> list[str]:
    if name == "demo":
        return []
    from lowmem_tpu.config.assets import ASSETS

    directory = OUT / "m100-config"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(M100, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ASSETS / "tiny-llama" / file, directory / file)
    return [f"model.name_or_path={directory.resolve()}", "model.random_init=true"]


def run(model: str, mode: str, steps: int, save: bool, name: str = "") -> dict[str, Any]:
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.run import run_training

    name = name or f"{model}-{mode}-{'save' if save else 'nosave'}"
    overrides = [
        f"output_dir={OUT / name}",
        f"train.max_steps={steps}",
        "train.logging_steps=5",
        "train.global_batch_size=16",
        "train.eval_samples=0",
        "data.eval_path=null",
        "train.resume=never",
        *(["train.save_steps=4", "train.keep_last=1"] if save else []),
        *(["lora.enabled=false", "train.learning_rate=1e-4"] if mode == "full" else []),
        *model_overrides(model),
    ]
    result = run_training(load_recipe("recipes/tiny_lora_cpu.yaml", overrides), overwrite=True)
    m = result.metrics
    return {
        "train_seconds": m["time"]["train_seconds"],
        "step_time": m["train"]["steady_step_time"],
        "saves": m["checkpoints"]["seconds"],
        "save_compiles": m["compiles"]["at_saves"],
        "after_warmup": m["compiles"]["after_warmup"],
        "trainable_parameters": m["trainable_parameters"],
        "total_parameters": m["total_parameters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--models", default="demo,m100")
    parser.add_argument("--modes", default="lora,full")
    args = parser.parse_args()
    results = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            run(model, mode, 8, True, f"{model}-{mode}-warmup")  # compiles the step and a save: both runs are warm
            plain, saving = (run(model, mode, args.steps, save) for save in (False, True))
            seconds = list(saving["saves"].values())
            results.append(
                {
                    "model": model,
                    "mode": mode,
                    "parameters": plain["total_parameters"],
                    "trainable": plain["trainable_parameters"],
                    "steps": args.steps,
                    "step_time": plain["step_time"],
                    "train_seconds_without_saves": plain["train_seconds"],
                    "train_seconds_saving_every_4": saving["train_seconds"],
                    "ratio": saving["train_seconds"] / plain["train_seconds"],
                    "save_seconds": seconds,
                    "save_compiles": saving["save_compiles"],
                    "compiles_after_warmup": saving["after_warmup"],
                }
            )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_checkpoint.json").write_text(json.dumps(results, indent=2) + "\n")
    header = "model  mode  params   step s  run s (no saves)  run s (save/4)  ratio  s/save (median)  compiles at saves"
    print("\n" + header)
    for r in results:
        saves = sorted(r["save_seconds"])
        median = saves[len(saves) // 2] if saves else float("nan")
        print(
            f"{r['model']:<6} {r['mode']:<5} {r['parameters'] / 1e6:6.1f}M  {r['step_time'] or 0:6.3f}  "
            f"{r['train_seconds_without_saves']:16.1f}  {r['train_seconds_saving_every_4']:14.1f}  "
            f"{r['ratio']:5.2f}  {median:19.2f}  {list(r['save_compiles'].values())}"
        )


if __name__ == "__main__":
    main()
