"""The steady-state training step traced with no weights behind it, for the TPU compiler.

``lowmem-tpu memory --compile`` needs the program a TPU would run at step N > 1: the weights,
the optimizer state and (full fine-tuning in bf16) the fp32 master weights as its inputs, the
updated ones donated. None of them has to exist: every parameter, optimizer tensor and master
weight is a torch_xla placeholder (device data with no buffer), so a 70B model traces in the host
RAM its graph needs. The optimizer state is made before the first step, with the shapes and dtypes
the optimizer's own first step gives them (found by running that step on ``meta`` twins), so the
first traced step is already the steady one (as the trainer's ``train.steady`` makes a run's; only
the in-place update of the trainable weights is left out: it would run the placeholders).

A placeholder can be traced, never run: the step's program is taken from the CPU compiler's dump
the moment torch_xla hands it over (``*.before_optimizations.hlo.pb``, written before the CPU
compiler starts); its execution is refused as the compilation starts, and the process leaves.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from lowmem_tpu.config import Recipe

BEFORE = "*.before_optimizations.hlo.pb"


def placeholder_model(recipe: Recipe, runtime: Any) -> tuple[Any, int]:
    """The recipe's model (quantized, LoRA applied) with every parameter a placeholder; buffers placed."""
    from lowmem_tpu.model import apply_lora, load_config, meta_model
    from lowmem_tpu.model.build import require_config
    from lowmem_tpu.xla.sharding import place_placeholders

    config = load_config(recipe.model, offline=True) or require_config(recipe)
    model = apply_lora(meta_model(config, recipe.model), recipe, weightless=True)
    made = place_placeholders(model)
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype).to(runtime.device)
    return model, made


def _meta_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The state the optimizer's first step creates for each of ``params``, on ``meta`` twins."""
    base = next(c for c in type(optimizer).__mro__ if c.__module__ != "lowmem_tpu.train.master")
    twins = [torch.zeros(p.shape, dtype=p.dtype, device="meta", requires_grad=True) for p in params]
    for twin in twins:
        twin.grad = torch.zeros_like(twin)
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**group, "params": twins[start : start + count]})
        start += count
    meta = base.__new__(base)
    torch.optim.Optimizer.__init__(meta, groups, optimizer.defaults)  # the same hyperparameters, as given
    meta.step()
    return [meta.state[t] for t in twins]


def prefill_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give every parameter the optimizer state of a step already taken, as placeholders.

    Tensors become placeholders of their shape and dtype; 0-d tensors (AdamW's step count) real
    ones on the host, where the optimizer keeps them. Returns the placeholders made.
    """
    from lowmem_tpu.xla.sharding import placeholder

    params = [p for group in optimizer.param_groups for p in group["params"]]
    made = []
    for param, state in zip(params, _meta_state(optimizer, params), strict=True):
        filled: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                filled[key] = value
            elif value.dim() == 0:
                filled[key] = torch.ones((), dtype=value.dtype)
            else:
                filled[key] = placeholder(value.shape, value.dtype)
                made.append(filled[key])
        optimizer.state[param] = filled
    return made


def resident_tensors(tensors: list[torch.Tensor]) -> list[tuple[list[int], int]]:
    """(shape, bytes per element) of tensors a micro-batch's program leaves untouched in HBM."""
    return [(list(t.shape), t.element_size()) for t in tensors]


class ProgramWatcher:
    """Waits, in a thread, for the next program torch_xla hands the CPU compiler, then calls ``done``.

    At the first sight of the program's dump (written as the CPU compiler starts) it refuses the
    program's execution (``xla.runtime.refuse_execution``): a program on placeholders must never run,
    and a small one compiles faster than its dump settles.
    """

    def __init__(self, dump: Path, done: Any):
        self.dump = dump
        self.done = done
        self.before = set(dump.glob(BEFORE))
        self.refused = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        from lowmem_tpu.xla.runtime import refuse_execution

        while True:
            new = sorted(set(self.dump.glob(BEFORE)) - self.before)
            if new and not self.refused.is_set():
                refuse_execution()
                self.refused.set()
            text = [Path(str(p).removesuffix(".hlo.pb") + ".txt") for p in new]
            ready = [(p, t) for p, t in zip(new, text, strict=True) if t.exists()]
            if ready and self._settled(ready[0]):
                self.done(*ready[0])
                return
            time.sleep(0.002)

    @staticmethod
    def _settled(files: tuple[Path, Path]) -> bool:
        """Both files written out: sizes unchanged over 50 ms and the text module closed."""
        sizes = [f.stat().st_size for f in files]
        time.sleep(0.05)
        closed = files[1].read_text().rstrip().endswith("}")
        return closed and sizes == [f.stat().st_size for f in files]
