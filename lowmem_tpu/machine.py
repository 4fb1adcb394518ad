"""What this machine is, read without torch: a TPU VM or not (where a run executes), and its RAM.

The one module that probes the machine for the others: a recipe's validity never depends on it
(``config`` imports nothing of this), ``preflight``, ``doctor`` and the runtime ask it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Platform = Literal["TPU", "CPU"]


def tpu_present() -> bool:
    """True on a TPU VM: PJRT_DEVICE=TPU, or TPU device files (/dev/accel*, /dev/vfio/N)."""
    chosen = os.environ.get("PJRT_DEVICE", "").upper()
    if chosen == "CPU":
        return False
    return chosen == "TPU" or any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def platform_for(device: str) -> Platform:
    """The platform a ``runtime.device`` setting (auto, tpu, cpu) runs on here."""
    return "TPU" if device == "tpu" or (device == "auto" and tpu_present()) else "CPU"


def on_tpu(device: str) -> bool:
    """True when a ``runtime.device`` setting runs on a TPU here."""
    return platform_for(device) == "TPU"


def host_memory() -> int:
    """This machine's RAM in bytes (/proc/meminfo; 16 GiB when it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 16 * 2**30


def meminfo(key: str) -> int:
    """One /proc/meminfo figure in bytes, e.g. ``MemAvailable`` (0 when it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
