"""What a run measures about itself: the log history (also as ``metrics.jsonl``, line by line as it
happens) and XLA compilations per step; which reporting integrations are installed."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lowmem_tpu.errors import UserError
from lowmem_tpu.train.plot import JSONL
from lowmem_tpu.xla import runtime as rt

# The package each train.report_to integration needs (transformers' own callbacks import them).
INTEGRATIONS = {
    "tensorboard": ("tensorboard", "pip install 'lowmem-tpu[tensorboard]' (in a clone, make install has it)"),
    "wandb": ("wandb", "pip install wandb"),
}


def check_reporters(reporters: list[str]) -> None:
    """A UserError naming the missing package and the command that installs it, before anything loads."""
    missing = [
        (name, *INTEGRATIONS[name]) for name in reporters if importlib.util.find_spec(INTEGRATIONS[name][0]) is None
    ]
    if missing:
        raise UserError(
            [
                f"train.report_to: {name} needs the {package} package, which is not installed: {fix} "
                "(or drop it from train.report_to)"
                for name, package, fix in missing
            ]
        )


class JsonlLog(TrainerCallback):
    """Appends one JSON object per log to ``output_dir/metrics.jsonl`` and flushes it at once.

    A crashed or preempted run keeps its curve. A resumed run first drops the lines after its
    checkpoint's step (the run that wrote them was lost), so the file reads as one run.
    """

    def __init__(self, output_dir: str | Path, runtime: Any = None):
        self.path = Path(output_dir) / JSONL
        self.runtime = runtime  # per-device memory figures, where the backend keeps them

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        kept = []
        if state.global_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= state.global_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        entry: dict[str, Any] = {"step": state.global_step, "time": round(time.time(), 3), **(logs or {})}
        devices = self.runtime.memory_per_device() if self.runtime else []
        if devices:
            entry["memory_per_device"] = devices
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


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
