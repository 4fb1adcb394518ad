"""Facts about the devices: their kind, peak FLOP/s, memory in use, and a tensor's sharding."""

from __future__ import annotations

from typing import Any

from lowmem_tpu.xla.devices import PEAK_FLOPS


def device_kind() -> str:
    """What the first device is, e.g. 'TPU v4' or 'cpu'."""
    import torch_xla.runtime as xr

    attributes = xr.global_runtime_device_attributes()
    return str(attributes[0].get("device_kind", "unknown")) if attributes else "unknown"


def peak_flops_per_device(kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of this kind (None off TPU or when unknown)."""
    for prefix, flops in sorted(PEAK_FLOPS.items(), key=lambda item: -len(item[0])):
        if kind.startswith(prefix):
            return flops
    return None


def sharding_spec(tensor: Any) -> str:
    """The XLA sharding annotation of a device tensor ('' when it has none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def memory_info() -> dict[str, int]:
    """Bytes in use, limit and peak of the first device; {} where none are kept (the CPU backend)."""
    import torch_xla

    # What xm.get_memory_info reads; under SPMD the virtual device may not resolve to a chip.
    for name in (str(torch_xla.device()), "TPU:0"):
        try:
            return dict(torch_xla._XLAC._xla_memory_info(name))
        except RuntimeError:
            continue
    return {}
