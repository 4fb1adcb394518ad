"""The TPU VM's hardware, read without torch_xla: which chips are attached, who holds them, HBM in use.

Under SPMD torch_xla cannot say either of the last two: its only device is the SPMD virtual
device, for which ``xm.get_memory_info`` and ``xm.xla_device_kind`` both fail (torch_xla 2.9,
``PjRtComputationClient::GetMemoryInfo``: "MemoryInfo not supported for SPMD virtual device";
``GetDeviceKind`` -> ``StringToPjRtDevice("SPMD:0")``: "Unknown device SPMD:0"; the same two
errors on the CPU backend, where tests/e2e/test_tpu_runtime.py checks them). So:

- the chips come from the PCI bus (Google's vendor id and each generation's device id, the table
  ``tpu-info`` reads), with ``TPU_ACCELERATOR_TYPE`` as a fallback;
- HBM in use and its limit per device come from libtpu's runtime metrics service (gRPC on
  localhost:8431, served by libtpu inside the process that holds the TPU: what ``tpu-info`` reads,
  through its protos; ``torch_xla[tpu]`` installs it). It has no peak: :class:`HbmMonitor` samples it.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lowmem_tpu.config.devices import GENERATIONS, Generation, device_for
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import tpu_present

if TYPE_CHECKING:
    from lowmem_tpu.config import Recipe

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device id -> generation (v2 and v3 share 0x0027 and differ by subsystem id).
PCI_DEVICES = {"0x005e": "v4", "0x0063": "v5e", "0x0062": "v5p", "0x006f": "v6e"}
PCI_V2_V3 = {"0x004e": "v2", "0x004f": "v3"}
METRICS_ADDRESS = "localhost:8431"
HBM_USED = "tpu.runtime.hbm.memory.usage.bytes"
HBM_TOTAL = "tpu.runtime.hbm.memory.total.bytes"


@dataclass(frozen=True)
class Chips:
    """The TPU chips attached to this VM."""

    generation: Generation | None
    count: int
    source: str  # "pci", "TPU_ACCELERATOR_TYPE" or "none"

    @property
    def xla_devices(self) -> int:
        return self.count * (self.generation.devices_per_chip if self.generation else 1)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def local_chips(sys_root: str = "/sys/bus/pci/devices") -> Chips:
    """The generation and number of TPU chips on the PCI bus (or named by ``TPU_ACCELERATOR_TYPE``)."""
    found: list[str] = []
    for device in glob.glob(f"{sys_root}/*"):
        if _read(f"{device}/vendor") != GOOGLE_PCI_VENDOR:
            continue
        pci_id = _read(f"{device}/device")
        name = PCI_V2_V3.get(_read(f"{device}/subsystem_device")) if pci_id == "0x0027" else PCI_DEVICES.get(pci_id)
        if name:
            found.append(name)
    if found:
        return Chips(GENERATIONS[max(set(found), key=found.count)], len(found), "pci")
    return _from_accelerator_type(os.environ.get("TPU_ACCELERATOR_TYPE", ""))


def _from_accelerator_type(text: str) -> Chips:
    """``v5litepod-8`` / ``v5e-8`` / ``v4-8`` / ``v3-8``: the generation, and chips (v2-v4, v5p count cores)."""
    match = re.fullmatch(r"(v\d)(litepod|e|p|lite)?-(\d+)", text.strip().lower())
    if not match:
        return Chips(None, 0, "none")
    version, variant, number = match.group(1), match.group(2) or "", int(match.group(3))
    name = version + {"litepod": "e", "lite": "e"}.get(variant, variant)
    generation = GENERATIONS.get(name)
    if generation is None:
        return Chips(None, 0, "none")
    per_chip = 2 if name in ("v2", "v3", "v4", "v5p") else 1  # cores in the name, per chip
    return Chips(generation, max(number // per_chip, 1), "TPU_ACCELERATOR_TYPE")


def default_device(recipe: Recipe) -> str:
    """What to plan for without ``--target``: the recipe's ``runtime.target``, else the TPU here, else ``cpu``."""
    if recipe.runtime.target:
        return recipe.runtime.target
    if recipe.runtime.device == "cpu" or not tpu_present():
        return "cpu"
    chips = local_chips()
    found = device_for(chips.generation.name, chips.xla_devices) if chips.generation else None
    if found is None:
        raise UserError("this TPU is not one the planner knows: name one with --target (or set runtime.target)")
    return found.name


def chip_owners(proc: str = "/proc") -> dict[str, int]:
    """TPU device files (/dev/accelN, /dev/vfio/N) that some process holds open, with its PID."""
    owners: dict[str, int] = {}
    for link in glob.glob(f"{proc}/[0-9]*/fd/*"):
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if re.fullmatch(r"/dev/(accel|vfio/)\d+", target):
            owners[target] = int(link.split("/")[-3])
    return owners


# ----------------------------------------------------------------------------- libtpu's runtime metrics


@dataclass(frozen=True)
class HbmUsage:
    """HBM of one XLA device, from libtpu's runtime metrics."""

    device: int
    used: int
    limit: int


class MetricsUnavailable(RuntimeError):
    """libtpu's runtime metrics cannot be read here; the message says why."""


def hbm_usage(address: str = METRICS_ADDRESS, timeout: float = 3.0) -> list[HbmUsage]:
    """HBM in use and its limit per device, now (MetricsUnavailable off a TPU or without tpu-info)."""
    try:
        import grpc
        from tpu_info.proto import tpu_metric_service_pb2 as pb
        from tpu_info.proto import tpu_metric_service_pb2_grpc as pb_grpc
    except ImportError as err:
        raise MetricsUnavailable(f"tpu-info is not installed ({err.name}): pip install tpu-info") from None
    with grpc.secure_channel(address, grpc.local_channel_credentials()) as channel:
        stub = pb_grpc.RuntimeMetricServiceStub(channel)

        def read(name: str) -> dict[int, int]:
            try:
                response = stub.GetRuntimeMetric(pb.MetricRequest(metric_name=name), timeout=timeout)
            except grpc.RpcError as err:
                raise MetricsUnavailable(f"no libtpu runtime metrics at {address}: {err.code().name}") from None
            return {m.attribute.value.int_attr: m.gauge.as_int for m in response.metric.metrics}

        used, total = read(HBM_USED), read(HBM_TOTAL)
    if not used:
        raise MetricsUnavailable(f"libtpu at {address} reported no HBM figures")
    return [HbmUsage(device, used[device], total.get(device, 0)) for device in sorted(used)]


@dataclass
class HbmMonitor:
    """Samples :func:`hbm_usage` every ``interval`` seconds in a thread; keeps each device's highest.

    libtpu reports HBM in use, not its peak: a sampled peak can miss a spike shorter than the
    interval (the TPU compiler's figure for the step, read by ``measure.local``, cannot).
    """

    interval: float = 0.25
    peaks: dict[int, int] = field(default_factory=dict)
    latest: list[HbmUsage] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> list[HbmUsage]:
        try:
            self.latest = hbm_usage()
        except MetricsUnavailable as err:
            self.error = str(err)
            return []
        self.error = None
        for usage in self.latest:
            self.peaks[usage.device] = max(self.peaks.get(usage.device, 0), usage.used)
        return self.latest

    def start(self) -> HbmMonitor:
        """Sample now and every ``interval`` seconds (libtpu's server may come up after the first try)."""
        self.sample()
        if self.error and "not installed" in self.error:
            return self  # nothing will ever answer: error says why

        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.sample()

        self._thread = threading.Thread(target=loop, name="hbm-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self.sample()

    def per_device(self) -> list[dict[str, int]]:
        """Each device's bytes in use (last sample), sampled peak and limit."""
        return [
            {"device": u.device, "used": u.used, "peak": self.peaks.get(u.device, u.used), "limit": u.limit}
            for u in self.latest
        ]
