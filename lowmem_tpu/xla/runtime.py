"""Starting torch_xla: the PJRT environment, SPMD, the mesh, the compile cache, compile counters."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu import hosts
from lowmem_tpu.config import RuntimeSection
from lowmem_tpu.config.devices import DEVICES, generation_of
from lowmem_tpu.console import quiet_python_warnings
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import platform_for
from lowmem_tpu.xla.device import device_kind, memory_monitor, peak_flops_per_device
from lowmem_tpu.xla.tpu import HbmMonitor

MESH_AXES = ("fsdp", "tensor")


@dataclass(frozen=True)
class Runtime:
    """What the run executes on: one SPMD mesh over every device."""

    platform: str  # "TPU" or "CPU"
    num_devices: int
    device: Any  # torch.device("xla:0"), the SPMD virtual device
    mesh: Any  # torch_xla.distributed.spmd.Mesh with axes ("fsdp", "tensor")
    compile_cache_dir: str | None
    kind: str = "unknown"  # device_kind, e.g. "TPU v5 lite", or "cpu"
    monitor: HbmMonitor | None = None  # HBM per device on a TPU (libtpu's runtime metrics)

    @property
    def peak_flops(self) -> float | None:
        """Peak bf16 FLOP/s of one device (None off TPU)."""
        return peak_flops_per_device(self.kind) if self.platform == "TPU" else None

    def memory_per_device(self) -> list[dict[str, int]]:
        """Bytes in use, sampled peak and limit of each device ([] where the backend keeps none: the CPU)."""
        return self.monitor.per_device() if self.monitor else []

    def describe(self) -> str:
        kind = f" ({self.kind})" if self.platform == "TPU" else ""
        return f"{self.num_devices} {self.platform} device{'s' if self.num_devices > 1 else ''}{kind}, SPMD fsdp mesh"


# libtpu flags every TPU program of ours is compiled with (a user's own LIBTPU_INIT_ARGS setting of the
# same flag wins). XLA's SPMD partitioner does not split RngBitGenerator: each chip would draw the random
# bits of the whole batch, which LoRA dropout's masks made 14.6 GiB per chip on a 4-layer Open Llama 3B
# LoRA step for v5e-8 (1.7 GiB without dropout; benchmarks/tpu_only_paths.py). This libtpu flag makes each
# chip draw only its own part's bits (other bits than one chip would draw: a dropout mask, not a result).
LIBTPU_FLAGS = ("--xla_tpu_spmd_rng_bit_generator_unsafe=true",)


# XLA:CPU (the CPU backend, rehearsals and tests): LLVM at level 1 compiles a tiny step's programs faster than
# the default and runs them as fast (the demo's recipe at 100 steps: 29 s against 32 s wall, 0.140 against
# 0.145 s a step); level 0 runs them slower. A user's own setting of the flag wins.
CPU_XLA_FLAGS = ("--xla_backend_optimization_level=1",)


def cpu_xla_flags(existing: str) -> str:
    """``XLA_FLAGS`` with :data:`CPU_XLA_FLAGS` added after the user's, unless the user set them."""
    return _with_flags(existing, CPU_XLA_FLAGS)


def without_cpu_flags(flags: str) -> str:
    """``XLA_FLAGS`` less the ones :func:`cpu_xla_flags` adds: what the TPU compiler is handed (the user's own)."""
    return " ".join(flag for flag in flags.split() if flag not in CPU_XLA_FLAGS)


def with_libtpu_flags(existing: str) -> str:
    """``LIBTPU_INIT_ARGS`` with :data:`LIBTPU_FLAGS` added after the user's, unless the user set them."""
    return _with_flags(existing, LIBTPU_FLAGS)


def _with_flags(existing: str, flags: tuple[str, ...]) -> str:
    """``existing`` flags with ``flags`` added after them, each unless the user set it."""
    set_by_user = {flag.split("=")[0] for flag in existing.split()}
    ours = [flag for flag in flags if flag.split("=")[0] not in set_by_user]
    return " ".join([*existing.split(), *ours])


def configure_environment(cfg: RuntimeSection) -> str:
    """Set the PJRT environment; must run before torch_xla (or transformers) is imported."""
    platform = platform_for(cfg.device)
    already = os.environ.get("PJRT_DEVICE")
    if already and already.upper() != platform and _xla_imported():
        raise UserError(f"runtime.device: this process already runs on {already}; start a new process for {platform}")
    os.environ["PJRT_DEVICE"] = platform
    if platform == "TPU":
        os.environ["LIBTPU_INIT_ARGS"] = with_libtpu_flags(os.environ.get("LIBTPU_INIT_ARGS", ""))
    if platform == "CPU" and not _xla_imported():
        os.environ["CPU_NUM_DEVICES"] = str(cfg.num_cpu_devices)
        os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if cfg.quiet:
        # The GSPMD deprecation notice is printed hundreds of times per compile.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return platform


def _xla_imported() -> bool:
    import sys

    return "torch_xla" in sys.modules


def setup_runtime(cfg: RuntimeSection) -> Runtime:
    """Start XLA in SPMD mode and build one ("fsdp", "tensor") mesh over every device."""
    platform = configure_environment(cfg)
    if cfg.quiet:
        quiet_python_warnings()
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
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
    kind = device_kind(platform)
    from lowmem_tpu.model.ordering import provide_barrier

    provide_barrier(xm.optimization_barrier_)  # the chunked loss's and attention's blocks, in turn
    from lowmem_tpu.model.experts import provide_kernel

    provide_kernel(None, num_devices)  # a MoE layer's tokens sorted per device, multiplied by the reference
    if platform == "TPU":
        _join_hosts(xr)
        _check_target(cfg.target, kind, num_devices)
        from lowmem_tpu.xla import experts, flash

        flash.install()  # the Pallas kernel behind model.attn_implementation: flash
        experts.install(num_devices)  # megablox's grouped matmuls behind a MoE layer's static experts
    return Runtime(platform, num_devices, device, mesh, cache_dir, kind, memory_monitor(platform))


def _join_hosts(xr: Any) -> None:
    """On a pod slice: this host's index and the gloo group of every host (torch_xla 2.9's ``xla://``
    rendezvous, distributed/xla_backend.py, takes rank and world size from PJRT). One VM: nothing."""
    count = xr.process_count()
    if count > 1:
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

    hosts.join(xr.process_index(), count, "xla://")


def slice_hosts(device: str = "auto") -> int:
    """Hosts of the TPU slice this machine belongs to, read before any TPU program starts (1 off a TPU).

    torch_xla 2.9's ``_internal/tpu.py num_tpu_workers`` (TPU_WORKER_HOSTNAMES or the VM's metadata).
    """
    if platform_for(device) != "TPU":
        return 1
    try:
        from torch_xla._internal import tpu

        return max(1, tpu.num_tpu_workers())
    except Exception:  # no metadata server: a lone VM
        return 1


def refuse_on_a_slice(command: str, device: str = "auto") -> None:
    """A one-host TPU program cannot start on one host of a pod slice (it waits for the others): say so."""
    count = slice_hosts(device)
    if count > 1:
        raise UserError(
            f"{command} runs a program on this host's chips alone, which cannot start on one host of a "
            f"{count}-host pod slice (it would wait for the other hosts); run it on a single-host TPU VM, or "
            "compile for the slice without running: lowmem-tpu memory RECIPE --compile --target <the slice>"
        )


def _check_target(target: str | None, kind: str, num_devices: int) -> None:
    """Warn when the TPU found is not the one the recipe was sized for (its plan may not hold here)."""
    planned = DEVICES.get(target or "")
    generation = generation_of(kind)
    if planned is None or generation is None:
        return
    if (planned.generation, planned.devices) != (generation.name, num_devices):
        here = f"{num_devices} x {kind}"
        warnings.warn(
            f"runtime.target is {planned.name} ({planned.about}) but this TPU is {here}: the recipe's memory "
            f"plan may not hold; check with: lowmem-tpu memory RECIPE --target <this TPU>",
            stacklevel=3,
        )


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


def cpu_fallbacks() -> list[str]:
    """The aten operations this process ran on the host because XLA has no lowering for them (each a device
    to host copy and back, and a program boundary); reading a value (``.item()``) is not one."""
    import torch_xla.debug.metrics as met

    return sorted(set(met.executed_fallback_ops()) - {"aten::_local_scalar_dense"})


def counter(name: str) -> int:
    """A torch_xla counter (0 when it never fired)."""
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return int(value or 0)


def sync() -> None:
    """Cut the lazy graph here and run it (one training step's worth of work)."""
    import torch_xla

    torch_xla.sync()


def refuse_execution() -> None:
    """Make the program being compiled raise instead of running once it is compiled.

    torch_xla 2.9's guard for ``torch_xla.compile(full_graph=True)`` (torch_xla/torch_xla.py): with
    ``XLAGraphExecutor::SetAllowExecution(false)``, ``ScheduleSyncTensorsGraph`` reaches
    ``DebugUtil::analyze_graph_execution_python_frame`` (torch_xla/csrc/debug_util.cpp), which raises
    "Unexpected execution happens inside the compiled function" before the program is scheduled.
    Set while a compilation is under way, it stops the execution and nothing else.
    """
    import torch_xla

    torch_xla._XLAC._set_allow_execution(False)


def wait() -> None:
    """Block until every queued device computation has finished."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def compile_seconds() -> float:
    """Seconds spent compiling XLA programs so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0
