"""fp32 master weights for bf16 full fine-tuning.

A bf16 weight has 8 bits of mantissa: an update smaller than half its ULP rounds to nothing, so
AdamW at lr 2e-5 applied to bf16 weights in place leaves most of them (and every norm weight)
unchanged. Here the optimizer owns an fp32 copy of every trainable weight, sharded like it. Each
step it reads the bf16 gradients into the fp32 copies, updates those, and writes them back to the
model rounded to bf16. The model still computes and gathers in bf16; the copies cost 4 bytes per
trainable parameter, split over the devices like the weights. Checkpoints hold them
(:func:`checkpoint_state`), so a resume continues from the exact fp32 values.

They are kept out of the optimizer's own ``state_dict()``: accelerate's ``AcceleratedOptimizer``
(accelerate 1.15, ``optimizer.py``) passes that dict through ``xm.send_cpu_data_to_device`` when it
wraps the optimizer, and torch_xla 2.9's ``utils.for_each_instance_rewrite`` ``copy.copy``s every XLA
tensor in it: a host round trip that rebuilds each one on the devices unsharded. For Open Llama 3B's
13.7 GB of masters that is a full replicated copy on every chip at once (found tracing the full recipe
with placeholders for the TPU compiler: the copy asked for data the placeholders do not have).
"""

from __future__ import annotations

from typing import Any

import torch

MASTERS = "master_weights"


class _MasterWeights:
    """Mixed into an optimizer class whose parameters are fp32 copies of the model's (``pairs``)."""

    pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
        loss = super().step(closure)  # type: ignore[misc]
        for param, master in self.pairs:
            param.copy_(master)  # rounded to the model's dtype
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, master in self.pairs:
            master.grad = None
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        super().zero_grad(set_to_none)  # type: ignore[misc]


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps ours


def checkpoint_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict, with the fp32 master weights under ``master_weights`` when it has them."""
    state = optimizer.state_dict()
    inner = _inner(optimizer)
    if isinstance(inner, _MasterWeights):
        state[MASTERS] = [master.detach() for _, master in inner.pairs]
    return state


def masters_of(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 master weights, in :func:`checkpoint_state`'s order ([] without them)."""
    inner = _inner(optimizer)
    return [master for _, master in inner.pairs] if isinstance(inner, _MasterWeights) else []


def restore_checkpoint_state(optimizer: Any, loaded: dict[tuple[int, str], Any], params: list[torch.Tensor]) -> None:
    """Put loaded optimizer state, by (parameter index, key), into the optimizer's state for ``params``.

    Tensors already on the devices (loaded in place, sharded like their parameter) stay as they are;
    ``step`` stays on the host as torch keeps it; other host tensors move to their parameter's device.
    The masters were loaded in place.
    """
    state = _inner(optimizer).state
    for (index, name), value in loaded.items():
        param = params[index]
        if isinstance(value, torch.Tensor) and name != "step" and value.device != param.device:
            value = value.to(param.device)
        state[param][name] = value


def with_master_weights(optimizer: torch.optim.Optimizer, fp32_copy: Any) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyperparameters) over fp32 copies of its low-precision weights.

    fp32 parameters are optimized in place as before; ``fp32_copy(param)`` makes each copy on the
    devices, sharded like its weight.
    """
    cls = type(f"{type(optimizer).__name__}WithMasterWeights", (_MasterWeights, type(optimizer)), {})
    pairs, groups = [], []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if param.dtype == torch.float32:
                params.append(param)
                continue
            master = fp32_copy(param).requires_grad_(True)
            pairs.append((param, master))
            params.append(master)
        groups.append({**group, "params": params})
    wrapped = cls.__new__(cls)
    torch.optim.Optimizer.__init__(wrapped, groups, optimizer.defaults)
    wrapped.pairs = pairs
    return wrapped


def fp32_copy(param: torch.Tensor, runtime: Any, strategy: str) -> torch.Tensor:
    """A master weight: ``param`` in fp32, through the host one tensor at a time, placed as the weights were.

    An fp32 cast made on the devices loses its sharding when a dimension does not divide by the device
    count (XLA then keeps a replicated copy, measured on 8 CPU devices with a 172-wide projection).
    """
    from lowmem_tpu.xla.sharding import place_like
    from lowmem_tpu.xla.transfer import to_host

    host = to_host(param.detach()).to(torch.float32)
    return place_like(host, param, runtime, strategy)
