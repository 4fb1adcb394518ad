"""Step 1 made the steady step, so that the training step compiles once and not twice (trap ``first-step-program``).

Left alone, step 1's program differs from every later one, and step 2 compiles the step again (on
a TPU, minutes more of warm-up for a 3B model). Measured on the tiny recipe with
``PT_XLA_DEBUG_LEVEL=1``; each of these differences alone gives step 2 a program of its own:

- AdamW creates its state inside step 1's program; from step 2 on it is the program's input.
- The running sums of the loss and the token counts start inside step 1; later steps add to them.
- The Trainer's loss scalar carries a replicated sharding from step 2 on (it is a step's output).
- A trainable weight not yet updated in place: the checkpointed backward shares one transposed
  copy of it, while after an in-place update every later step rebuilds the transpose at each use.
- A warm-up's first learning rate, 0: torch_xla keeps the scalars 0 and +-1 as constants of a
  program, any other as an input (torch_xla 2.9 ``csrc/init_python_bindings.cpp``,
  ``MapXlaEnvVarsToLazy``: ``XLA_NO_SPECIAL_SCALARS`` unset leaves torch lazy's
  ``handle_special_scalars`` on), so that step's update is another program, and it trains nothing.

Adafactor's first step is another program anyway (its second-moment decay is exactly 0 at step 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def no_zero_first_rate(scheduler: Any) -> None:
    """Step 1 takes step 2's learning rate where the schedule gives it 0 (a linear warm-up's first step)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return

    def shifted(rate: Callable[[int], float]) -> Callable[[int], float]:
        def rate_of(step: int) -> float:  # a function: the scheduler's state_dict leaves it out
            return rate(1) if step == 0 and rate(0) == 0 else rate(step)

        return rate_of

    scheduler.lr_lambdas = [shifted(rate) for rate in scheduler.lr_lambdas]
    rates = [
        base * rate(scheduler.last_epoch) for rate, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = lr
    scheduler._last_lr = rates


def make_adam_state(optimizer: torch.optim.Optimizer, zeros: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """AdamW's state for every parameter that has none, as its first step would make it; the count made.

    ``zeros(param)`` makes each moment (on the devices, sharded like ``param``). ``step`` stays a host
    tensor, as torch keeps it without ``capturable`` or ``fused`` (torch/optim/adam.py, ``_init_group``).
    Other optimizers are left to make their own.
    """
    if not isinstance(optimizer, torch.optim.Adam):
        return 0
    made = 0
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue  # torch keeps ``step`` on the device then: left to torch
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for param in group["params"]:
            if not optimizer.state[param]:
                state = {"step": torch.tensor(0.0, dtype=torch.get_default_dtype())}
                optimizer.state[param] = state | {key: zeros(param) for key in keys}
                made += 1
    return made


@torch.no_grad()
def update_in_place(params: Iterable[torch.Tensor]) -> None:
    """An in-place update that changes no value, as the optimizer's own will be."""
    for param in params:
        param.mul_(1.0)


def make_step_state(
    optimizer: Any, trainable: Iterable[torch.Tensor], runtime: Any, strategy: str, *, placeholders: bool = False
) -> None:
    """The optimizer's state and the trainable weights as step 1 leaves them (the first and fourth above).

    ``placeholders``: the weights are the TPU compiler's placeholders (``measure.child``), traced and never run.
    """
    from lowmem_tpu.xla.sharding import zeros_placed

    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps ours
    make_adam_state(optimizer, lambda p: zeros_placed(p, runtime, strategy))
    if not placeholders:  # a placeholder can be traced, never run
        update_in_place(trainable)


def replicate_running(tensors: Iterable[torch.Tensor], runtime: Any) -> None:
    """The running sums and the Trainer's loss scalar replicated as a step's outputs are, then all of it run."""
    from lowmem_tpu.xla import runtime as rt
    from lowmem_tpu.xla.sharding import replicate

    for tensor in tensors:
        replicate(tensor, runtime.mesh)
    rt.sync()
