"""The TPU VMs people use, as plain data: XLA devices per VM, memory per device, peak bf16 FLOP/s.

Imports no torch: the planner (no torch) and the runtime (MFU) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_tpu.errors import UserError

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One kind of TPU VM (or this machine's CPU backend): XLA devices and memory per device."""

    name: str
    devices: int
    hbm_bytes: int
    about: str


# A v2-8/v3-8 shows 8 XLA devices (one per core); from v4 on, one device per chip
# (v4-8 and v5p-8 have 4 chips: the name counts TensorCores).
DEVICES = {
    d.name: d
    for d in (
        Device("v2-8", 8, 8 * GiB, "TPU v2-8: 8 cores x 8 GiB"),
        Device("v3-8", 8, 16 * GiB, "TPU v3-8 (Kaggle, Colab): 8 cores x 16 GiB"),
        Device("v4-8", 4, 32 * GiB, "TPU v4-8: 4 chips x 32 GiB"),
        Device("v5e-1", 1, 16 * GiB, "TPU v5e-1: 1 chip x 16 GiB"),
        Device("v5e-8", 8, 16 * GiB, "TPU v5e-8: 8 chips x 16 GiB"),
        Device("v5p-8", 4, 95 * GiB, "TPU v5p-8: 4 chips x 95 GiB"),
        Device("v6e-8", 8, 32 * GiB, "TPU v6e-8: 8 chips x 32 GiB"),
    )
}


def find_device(name: str, cpu_devices: int) -> Device:
    """A known device by name; ``cpu`` is this machine's memory split over ``runtime.num_cpu_devices``."""
    if name == "cpu":
        return Device("cpu", cpu_devices, _host_memory() // cpu_devices, f"CPU backend: {cpu_devices} devices")
    if name not in DEVICES:
        known = ", ".join([*DEVICES, "cpu"])
        raise UserError(f"--device: unknown device {name!r}; known devices: {known}")
    return DEVICES[name]


def _host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 16 * GiB


# Peak dense bf16 FLOP/s of one XLA device (a core on v2/v3, a chip from v4 on), by device_kind prefix.
PEAK_FLOPS = {
    "TPU v2": 22.5e12,
    "TPU v3": 61.5e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}
