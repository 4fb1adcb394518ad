"""The training progress a person watches: a bar on stderr, one line per log on stdout."""

from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback

from lowmem_tpu.console import size


def format_log(step: int, max_steps: int, logs: dict[str, float]) -> str:
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}"]
    fields = [
        ("loss", "loss {:.4f}"),
        ("eval_loss", "eval loss {:.4f}"),
        ("token_accuracy", "tok acc {:.3f}"),
        ("eval_token_accuracy", "eval tok acc {:.3f}"),
        ("rewards/accuracies", "pref acc {:.3f}"),
        ("eval_rewards/accuracies", "eval pref acc {:.3f}"),
        ("rewards/margins", "margin {:.3f}"),
        ("rewards/chosen", "chosen {:+.3f}"),
        ("rewards/rejected", "rejected {:+.3f}"),
        ("learning_rate", "lr {:.2e}"),
        ("grad_norm", "grad {:.3f}"),
        ("tokens_per_second", "{:,.0f} tok/s"),
        ("step_time", "{:.3f} s/step"),
        ("mfu", "MFU {:.1%}"),
    ]
    parts += [template.format(logs[key]) for key, template in fields if key in logs]
    planned = logs.get("memory_planned_gib")
    if "memory_peak_gib" in logs:
        plan = f" (planned {size(planned * 2**30)})" if planned else ""
        parts.append(f"HBM peak {size(logs['memory_peak_gib'] * 2**30)}/dev{plan}")
    elif planned:
        parts.append(f"memory planned {size(planned * 2**30)}/dev")
    return " | ".join(parts)


class ProgressCallback(TrainerCallback):
    """A tqdm bar on stderr; each log becomes one line on stdout."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        from tqdm.auto import tqdm

        # disable=None: a bar on a terminal, none in a log file (the log lines still print)
        self.bar = tqdm(
            total=state.max_steps, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True, disable=None
        )

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        logs = logs or {}
        if self.bar is not None and ("loss" in logs or "eval_loss" in logs):
            self.bar.write(format_log(state.global_step, state.max_steps, logs), file=sys.stdout)
            if "loss" in logs:
                self.bar.set_postfix(loss=f"{logs['loss']:.4f}")

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
