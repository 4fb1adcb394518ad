"""The one place that sets up torch_xla: devices, SPMD, the mesh, the compile cache, counters.

Everything else talks to XLA through this module (and ``sharding``), so that another
backend can later sit beside it.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError
from lowmem_tpu.recipe import RuntimeSection, tpu_present

MESH_AXES = ("fsdp", "tensor")


@dataclass(frozen=True)
class Runtime:
    """What the run executes on: one SPMD mesh over every device."""

    platform: str  # "TPU" or "CPU"
    num_devices: int
    device: Any  # torch.device("xla:0"), the SPMD virtual device
    mesh: Any  # torch_xla.distributed.spmd.Mesh with axes ("fsdp", "tensor")
    compile_cache_dir: str | None
    kind: str = "unknown"  # device_kind, e.g. "TPU v4"

    @property
    def peak_flops(self) -> float | None:
        """Peak bf16 FLOP/s of one device (None off TPU)."""
        return peak_flops_per_device(self.kind) if self.platform == "TPU" else None

    def describe(self) -> str:
        return f"{self.num_devices} {self.platform} device{'s' if self.num_devices > 1 else ''} (SPMD, fsdp mesh)"


def configure_environment(cfg: RuntimeSection) -> str:
    """Set the PJRT environment; must run before torch_xla (or transformers) is imported."""
    platform = "TPU" if cfg.device == "tpu" or (cfg.device == "auto" and tpu_present()) else "CPU"
    already = os.environ.get("PJRT_DEVICE")
    if already and already.upper() != platform and _xla_imported():
        raise UserError(f"runtime.device: this process already runs on {already}; start a new process for {platform}")
    os.environ["PJRT_DEVICE"] = platform
    if platform == "CPU" and not _xla_imported():
        os.environ["CPU_NUM_DEVICES"] = str(cfg.num_cpu_devices)
    if cfg.quiet:
        # The GSPMD deprecation notice is printed hundreds of times per compile.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return platform


def _xla_imported() -> bool:
    import sys

    return "torch_xla" in sys.modules


def quiet_python_warnings() -> None:
    """Silence library warnings that say nothing actionable to a user of this tool."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("transformers", "torch_xla", "accelerate", "datasets", "peft", "trl", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - both are dependencies
        pass


def setup_runtime(cfg: RuntimeSection) -> Runtime:
    """Start XLA in SPMD mode and build one ("fsdp", "tensor") mesh over every device."""
    platform = configure_environment(cfg)
    if cfg.quiet:
        quiet_python_warnings()
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    cache_dir = _init_cache(cfg.compile_cache_dir, platform, xr)
    xr.use_spmd()
    num_devices = xr.global_runtime_device_count()
    if platform == "CPU" and num_devices != cfg.num_cpu_devices:
        warnings.warn(f"this process already runs {num_devices} CPU devices", stacklevel=2)
    mesh = xs.Mesh(np.arange(num_devices), (num_devices, 1), MESH_AXES)
    xs.set_global_mesh(mesh)
    device = torch_xla.device()
    assert isinstance(device, torch.device)
    return Runtime(platform, num_devices, device, mesh, cache_dir, device_kind())


def _init_cache(path: str | None, platform: str, xr: Any) -> str | None:
    """Point torch_xla's persistent compilation cache at ``path`` (``auto``: the user's cache dir)."""
    if not path:
        return None
    import torch_xla

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if path == "auto":
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        directory = root / "lowmem-tpu" / f"xla-{platform.lower()}"
    else:
        directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(directory), readonly=False)
    return str(directory)


def cache_stats() -> dict[str, int]:
    """Persistent compilation cache counters of this process."""
    return {
        "hits": counter("PersistentCacheHit"),
        "misses": counter("PersistentCacheMiss"),
        "unreadable": counter("PersistentCacheDeserializeFailure"),
    }


def compile_count() -> int:
    """Number of XLA compilations so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def counter(name: str) -> int:
    """A torch_xla counter (0 when it never fired)."""
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return int(value or 0)


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


def sync() -> None:
    """Cut the lazy graph here and run it (one training step's worth of work)."""
    import torch_xla

    torch_xla.sync()


def wait() -> None:
    """Block until every queued device computation has finished."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


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


def compile_seconds() -> float:
    """Seconds spent compiling XLA programs so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0
