"""Facts about the devices a run uses: their kind, peak FLOP/s, memory per device, a tensor's sharding.

The kind and the memory are read from the hardware (:mod:`lowmem_tpu.xla.tpu`), not from torch_xla:
under SPMD torch_xla 2.9 answers neither (see that module).
"""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config.devices import generation_of
from lowmem_tpu.xla.tpu import HbmMonitor, local_chips


def device_kind(platform: str) -> str:
    """What the devices are, as PJRT names them ("TPU v5 lite", "TPU v4", ...), "cpu", or "unknown"."""
    if platform != "TPU":
        return "cpu"
    chips = local_chips()
    return chips.generation.kind if chips.generation else "unknown"


def peak_flops_per_device(kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one XLA device of this kind (None for the CPU or an unknown kind)."""
    generation = generation_of(kind)
    return generation.peak_flops if generation else None


def sharding_spec(tensor: Any) -> str:
    """The XLA sharding annotation of a device tensor ('' when it has none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def memory_monitor(platform: str) -> HbmMonitor | None:
    """A running HBM monitor on a TPU (None on the CPU backend, which keeps no allocator statistics)."""
    return HbmMonitor().start() if platform == "TPU" else None
