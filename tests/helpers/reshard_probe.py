"""Restore a checkpoint on this process's device count, then save it again (tests/e2e/test_checkpoint.py runs it).

    CPU_NUM_DEVICES=8 python tests/helpers/reshard_probe.py CHECKPOINT OUT_DIR [KEY=VALUE ...]

Builds the run as ``lowmem-tpu sft`` does (same recipe, overrides, model and optimizer), loads the
checkpoint through the trainer's own resume path, and writes it back through the trainer's own save,
as ``OUT_DIR/checkpoints/step-N``: the two must hold the same state bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(checkpoint: Path, out: Path, overrides: list[str]) -> None:
    from lowmem_tpu import run
    from lowmem_tpu.config import load_recipe, micro_batch_size
    from lowmem_tpu.xla.runtime import setup_runtime

    recipe = load_recipe("recipes/tiny_lora_cpu.yaml", [*overrides, f"output_dir={out}"])
    out.mkdir(parents=True, exist_ok=True)
    runtime = setup_runtime(recipe.runtime)
    tokenizer = run._tokenizer(recipe)
    train_ds, _, eval_ds, _ = run._data(recipe, tokenizer, out)
    job = run._build(recipe, runtime, tokenizer, train_ds, eval_ds, micro_batch_size(recipe, runtime.num_devices), out)
    trainer = job.trainer
    trainer._wrap_model(trainer.model)  # the wrapped model and its optimizer, as training starts them
    trainer.create_scheduler(num_training_steps=recipe.train.max_steps, optimizer=trainer.optimizer)
    trainer._load_from_checkpoint(str(checkpoint))
    trainer._load_optimizer_and_scheduler(str(checkpoint))
    trainer.state.global_step = int(checkpoint.name.removeprefix("step-"))
    trainer._save_checkpoint(trainer.model, None)
    print(f"saved on {runtime.num_devices} devices: {trainer.last_checkpoint}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
