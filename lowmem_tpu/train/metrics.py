"""What a run measures about itself: the log history and XLA compilations per step."""

from __future__ import annotations

from transformers import TrainerCallback

from lowmem_tpu.xla import runtime as rt


class MetricsCallback(TrainerCallback):
    """Collects the log history and this run's XLA compile count after every step.

    Counts start when the callback is made, so several runs in one process each count their own.
    """

    def __init__(self) -> None:
        self.compiles_at_start, self.compile_seconds_at_start = rt.compile_count(), rt.compile_seconds()
        self.compiles_by_step: dict[int, int] = {}
        self.logs: list[dict[str, float]] = []
        self.first_log_step: int | None = None
        self.first_eval_step: int | None = None
        self.training = False

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.training = True

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.training = False

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.compiles_by_step[state.global_step] = rt.compile_count() - self.compiles_at_start

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        entry = {"step": state.global_step, **(logs or {})}
        self.logs.append(entry)
        if not self.training:
            return
        if any(k.startswith("eval_") for k in entry):
            self.first_eval_step = state.global_step if self.first_eval_step is None else self.first_eval_step
        elif "loss" in entry:
            self.first_log_step = state.global_step if self.first_log_step is None else self.first_log_step

    def warmup_end(self, max_steps: int) -> int:
        """Warm-up lasts until the step after the first log and the first evaluation."""
        marks = [3] + [s + 1 for s in (self.first_log_step, self.first_eval_step) if s is not None]
        return min(max(marks), max_steps)
