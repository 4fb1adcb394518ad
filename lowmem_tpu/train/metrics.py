"""What a run measures about itself: the log history (also as ``metrics.jsonl``, line by line as it
happens) and XLA compilations per step; the loss's companions summed on the device and the log's
figures made from them (throughput, MFU, memory). Whether the reporting integrations are installed
is ``lowmem_tpu.preflight``'s question."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.train.plot import JSONL
from lowmem_tpu.xla import runtime as rt


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


RUNNING = ("tokens", "label_tokens", "correct")  # the running sums of each mode, from which the figures come
MEAN = "mean:"  # a method's figure: the sum over micro-batches of its per-micro-batch value (``add_means``)
COUNT = "count:"  # and the micro-batches that had it


class DeviceMetrics:
    """The loss's companions kept on the device between logs (trap ``per-step-item``), read at logging time.

    Running sums by ``MODE/KEY`` (tokens, label tokens, correct predictions), and from them the log's
    figures: token accuracy, step time, tokens per second, MFU, and the per-device memory; a method's own
    figures (DPO's rewards, ORPO's log odds: ``config.methods``) as TRL logs them, the mean over the window's
    micro-batches of each micro-batch's value.
    """

    def __init__(self, recipe: Any, runtime: Any, flops_per_token: float | None, planned_bytes: int | None):
        self.recipe, self.runtime = recipe, runtime
        self.flops_per_token = flops_per_token
        self.planned_bytes = planned_bytes  # the planner's peak per device for this run
        self.totals: dict[str, torch.Tensor] = {}
        self._last_log: tuple[float, dict[str, float]] | None = None

    def start(self, step: int) -> None:
        """Throughput is measured from here (a run's first step, or its resumed one)."""
        self._last_log = (time.perf_counter(), {"step": step})

    def add(self, mode: str, **values: torch.Tensor) -> None:
        for key, value in values.items():
            name = f"{mode}/{key}"
            value = value.detach().float()
            self.totals[name] = self.totals[name] + value if name in self.totals else value

    def add_means(self, mode: str, figures: dict[str, Any]) -> None:
        """One micro-batch's figures, each averaged over the micro-batches between two logs that had it: a
        figure is a device scalar, or (value, present) where a micro-batch may not have it (KTO's rewards of
        a side with no rows)."""
        for key, figure in figures.items():
            value, present = figure if isinstance(figure, tuple) else (figure, torch.ones_like(figure))
            self.add(mode, **{f"{MEAN}{key}": value * present, f"{COUNT}{key}": present})

    def zeros(self, mode: str) -> list[torch.Tensor]:
        """Every running sum, ``mode``'s not started yet started at 0 (step 1 as step 2 has them: ``train.steady``)."""
        method = METHODS[self.recipe.method]
        # a preference method's token accuracy is TRL's own (mean_token_accuracy), not counted here
        running = RUNNING[:2] if method.preference else RUNNING
        means = [f"{kind}{key}" for key in method.metrics for kind in (MEAN, COUNT)]
        for key in (*running, *means):
            self.totals.setdefault(f"{mode}/{key}", torch.zeros((), device=self.runtime.device))
        return list(self.totals.values())

    def read(self, mode: str) -> dict[str, float]:
        """Host copies of the running device-side sums (a sync: call at logging time only)."""
        names = [name for name in self.totals if name.startswith(f"{mode}/")]
        values = torch.stack([self.totals[n] for n in names]).cpu().tolist() if names else []
        return {n.split("/", 1)[1]: v for n, v in zip(names, values, strict=True)}

    def means(self, mode: str) -> dict[str, float]:
        """The method's figures over every micro-batch so far (a sync)."""
        return _means(self.read(mode), {})

    def figures(self, mode: str, step: int) -> dict[str, float]:
        """What a log adds to the Trainer's: throughput and memory in training, token accuracy in evaluation."""
        totals = self.read(mode)
        if mode == "train":
            return self._throughput(totals, step) | self._memory()
        if not totals:
            return {}
        for name in [n for n in self.totals if n.startswith("eval/")]:
            del self.totals[name]  # each evaluation reports its own figures
        means = {f"eval_{key}": value for key, value in _means(totals, {}).items()}
        return means | (
            {"eval_token_accuracy": totals["correct"] / max(totals["label_tokens"], 1)} if "correct" in totals else {}
        )

    def _throughput(self, totals: dict[str, float], step: int) -> dict[str, float]:
        now = time.perf_counter()
        if not totals:
            return {}
        previous_time, previous = self._last_log or (now, {"step": step})
        self._last_log = (now, totals | {"step": step})
        steps = step - previous["step"]
        delta = {k: totals[k] - previous.get(k, 0.0) for k in totals}
        out = {"token_accuracy": delta["correct"] / max(delta["label_tokens"], 1)} if "correct" in delta else {}
        out |= _means(totals, previous)
        if steps and now > previous_time:
            seconds = now - previous_time
            out |= {
                "step_time": seconds / steps,
                "tokens_per_second": delta["tokens"] / seconds,
                "tokens_per_second_per_device": delta["tokens"] / seconds / self.runtime.num_devices,
            }
            if self.runtime.peak_flops and self.flops_per_token:
                # Padding tokens are computed too: count every position, not only real tokens.
                rows = METHODS[self.recipe.method].rows_per_example  # a pair: chosen and rejected
                positions = steps * self.recipe.train.global_batch_size * rows * self.recipe.data.max_length
                achieved = positions * self.flops_per_token / seconds / self.runtime.num_devices
                out["mfu"] = achieved / self.runtime.peak_flops
        return out

    def _memory(self) -> dict[str, float]:
        """Per-device memory for the log line: the plan always, the device's figures where it keeps them."""
        out = {"memory_planned_gib": self.planned_bytes / 2**30} if self.planned_bytes else {}
        devices = self.runtime.memory_per_device()
        if devices:
            out["memory_used_gib"] = max(d["used"] for d in devices) / 2**30
            out["memory_peak_gib"] = max(d["peak"] for d in devices) / 2**30
            out["memory_limit_gib"] = min(d["limit"] for d in devices) / 2**30
        return out


def _means(totals: dict[str, float], previous: dict[str, float]) -> dict[str, float]:
    """A method's figures over the micro-batches since ``previous``: the mean of each micro-batch's value, over
    those that had it (none: not logged, as TRL logs nothing for it)."""
    out = {}
    for key, value in totals.items():
        if not key.startswith(MEAN):
            continue
        name = key.removeprefix(MEAN)
        count = totals[f"{COUNT}{name}"] - previous.get(f"{COUNT}{name}", 0.0)
        if count > 0:
            out[name] = (value - previous.get(key, 0.0)) / count
    return out
