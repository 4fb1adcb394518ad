"""Step 1 is the steady step, on real runs: step 2 compiles nothing, on the CPU backend and on a TPU, and the
training arguments keep the recipe's warm-up (the optimizer state and the first rate: unit/test_steady.py)."""

from __future__ import annotations

import pytest
from tiny_models import train_tiny


def _compiles_by_step(run) -> dict[int, int]:
    from lowmem_tpu.train.metrics import MetricsCallback

    return next(c for c in run.trainer.callback_handler.callbacks if isinstance(c, MetricsCallback)).compiles_by_step


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        ("train.gradient_accumulation_steps=2", "lora.dropout=0.1"),
        ("lora.enabled=false", "model.dtype=bfloat16"),  # fp32 master weights
    ],
    ids=["lora-accumulation", "full-bf16-masters"],
)
def test_step_2_compiles_nothing(tmp_path_factory, mode):
    """A step's programs compile when the next step starts (its micro-batches' within it): nothing
    compiled in step 3 means step 2's programs were step 1's."""
    _, run = train_tiny(
        tmp_path_factory,
        "steady",
        "train.max_steps=4",
        "train.logging_steps=4",
        "train.warmup_steps=2",
        "train.global_batch_size=16",
        "train.eval_samples=0",
        "data.eval_path=null",
        *mode,
    )
    by_step = _compiles_by_step(run)
    assert by_step[3] == by_step[2], by_step


@pytest.mark.parametrize(("warmup", "expected"), [(10, "constant_with_warmup"), (0, "constant")])
def test_a_constant_schedule_keeps_the_recipes_warm_up(tmp_path, warmup, expected):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.train.args import training_args

    overrides = [f"output_dir={tmp_path}", "train.lr_scheduler=constant", f"train.warmup_steps={warmup}"]
    args = training_args(load_recipe("recipes/tiny_lora_cpu.yaml", overrides), micro_batch=16)
    assert args.lr_scheduler_type == expected and args.warmup_steps == warmup


@pytest.mark.tpu
def test_on_a_tpu_step_2_compiles_nothing(tmp_path_factory):  # pragma: no cover - TPU only
    """The same as on the CPU backend, through libtpu's compiler and runtime (a real TPU's warm-up)."""
    _, run = train_tiny(
        tmp_path_factory,
        "steady-tpu",
        "runtime.device=tpu",
        "runtime.target=null",
        "model.dtype=bfloat16",
        "train.max_steps=4",
        "train.logging_steps=4",
        "train.warmup_steps=2",
        "train.gradient_accumulation_steps=2",
        "train.eval_samples=0",
        "data.eval_path=null",
    )
    by_step = _compiles_by_step(run)
    assert by_step[3] == by_step[2], by_step
