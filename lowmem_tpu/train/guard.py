"""Stopping well: SIGTERM, SIGINT and ``train.max_wall_time`` save first, non-finite losses stop or skip the update."""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import torch
from transformers import TrainerCallback

from lowmem_tpu import faults, hosts
from lowmem_tpu.errors import NonFiniteError


class GuardCallback(TrainerCallback):
    """Stops on SIGTERM, SIGINT or before ``train.max_wall_time`` (saving first), and on non-finite losses."""

    def __init__(self, max_wall_seconds: float | None, spike_factor: float, warn: Any, skip_nonfinite: bool = False):
        self.deadline = time.monotonic() + max_wall_seconds if max_wall_seconds else None
        self.spike_factor = spike_factor
        self.warn = warn
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps: list[int] = []
        self.stop_reason: str | None = None
        self.losses: list[float] = []
        self.last_step_end = time.monotonic()
        self.slowest = 0.0

    def request_stop(self, signum: int, frame: Any) -> None:
        """Signal handler (SIGTERM, SIGINT): only sets a flag; the save happens at the next step boundary.

        A second SIGINT (Ctrl-C twice, a notebook's interrupt twice) stops at once, without saving."""
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.stop_reason == "SIGINT":
            raise KeyboardInterrupt
        self.stop_reason = self.stop_reason or name
        if name == "SIGINT":
            self.warn("interrupted: saving at the end of this step, then stopping (interrupt again to stop now)")

    def on_step_end(self, args, state, control, **kwargs) -> None:
        faults.point("step")  # the fault matrix's kill at a step boundary (before this step's save)
        now = time.monotonic()
        self.slowest = max(self.slowest * 0.9, now - self.last_step_end)
        self.last_step_end = now
        # Leave room for a few more steps and a checkpoint before the deadline.
        if self.deadline and self.stop_reason is None and now + 3 * self.slowest + 30 > self.deadline:
            self.stop_reason = "max_wall_time"
        # On a pod slice every host stops at the same step, or the others hang in the next collective.
        self.stop_reason = hosts.agree_stop(self.stop_reason)
        if self.stop_reason:
            control.should_save = True
            control.should_training_stop = True

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        """In skip mode, drop every gradient of a step whose gradients are not all finite.

        Parameters without a gradient are left alone by the optimizer (no moment or decay update; with
        master weights their fp32 copies get none either), so the step is skipped exactly. The check
        costs one host sync per step.
        """
        if not self.skip_nonfinite:
            return
        # The model's parameters hold the gradients (with master weights, the optimizer's fp32 copies
        # get theirs only inside its step); the optimizer's own are checked too.
        owners = [*(model.parameters() if model is not None else ()), *_optimized(optimizer)]
        params = list({id(p): p for p in owners if p.grad is not None}.values())
        if not params or torch.stack([torch.isfinite(p.grad).all() for p in params]).all().item():
            return
        for param in params:
            param.grad = None
        self.skipped_steps.append(state.global_step + 1)
        self.warn(f"warning: step {state.global_step + 1}: non-finite gradients, update skipped")

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        logs = logs or {}
        for key in ("loss", "grad_norm"):
            value = logs.get(key)
            if value is not None and not math.isfinite(value) and not self.skip_nonfinite:
                raise NonFiniteError(f"step {state.global_step}: {key} is {value}; stopped, no checkpoint written")
        loss = logs.get("loss")
        if loss is None or not math.isfinite(loss):
            return
        if self.spike_factor and len(self.losses) >= 3 and state.global_step > args.warmup_steps:
            mean = sum(self.losses[-20:]) / len(self.losses[-20:])
            if loss > self.spike_factor * mean:
                self.warn(f"warning: loss spike at step {state.global_step}: {loss:.4f} vs running mean {mean:.4f}")
        self.losses.append(loss)


def _optimized(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
