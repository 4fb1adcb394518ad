"""Where a run executes, decided in one place and without importing torch: a TPU or the CPU backend."""

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
