"""The TPU VMs people use, as plain data: XLA devices, memory and peak bf16 FLOP/s per device.

Imports no torch: the recipe (``runtime.target``), the planner and the runtime (MFU) all read it.
A v2-8/v3-8 shows 8 XLA devices (one per TensorCore, two per chip); from v4 on there is one XLA
device per chip (a v4-8 or v5p-8 has 4 chips: those names count TensorCores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowmem_tpu.errors import UserError

GiB = 2**30


@dataclass(frozen=True)
class Generation:
    """One TPU chip generation, per XLA device (a core on v2/v3, a chip from v4 on)."""

    name: str  # "v5e"
    kind: str  # what PJRT calls it (device_kind), e.g. "TPU v5 lite"
    hbm_bytes: int  # nominal HBM per XLA device
    usable_bytes: int  # what the TPU compiler allows a program ("Used X of <usable> hbm")
    peak_flops: float  # dense bf16 FLOP/s per XLA device
    hbm_bandwidth: float  # HBM bytes/s per XLA device
    devices_per_chip: int = 1
    # The TensorCore's clock: the TPU compiler's ``estimated_cycles`` over it are seconds. Read off the
    # peak: MXUs x 128 x 128 multiply-adds x 2 x clock (v5e: 4 MXUs, 197e12 / 131072 = 1.5 GHz; v4 and
    # v5p: 8 MXUs per chip). None where the MXU count is not settled (v6e's is given as 2 and as 4).
    clock_hz: float | None = None
    # The interconnect, per chip, as Google's Cloud TPU pages publish it (docs.cloud.google.com/tpu/docs/v5e,
    # v5p, v6e: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip)", "ICI ports per chip"): the
    # bytes/s in and out together over all of its ports. None where no per-chip figure is published (v4).
    ici_bandwidth: float | None = None
    ici_ports: int | None = None


# A TPU vector register's lane count: every TPU generation tiles an array's last dimension in 128 lanes.
LANES = 128


def _g(gib: float) -> int:
    return int(gib * GiB)


# usable_bytes: the capacity in the TPU compiler's RESOURCE_EXHAUSTED messages ("Used 21.9G of 7.48G
# hbm" on v2, 15.48G v3, 30.75G v4, 15.75G v5e) and tpu-info's total (31.25 GiB on v6e); v5p: nominal.
GENERATIONS = {
    g.name: g
    for g in (
        Generation("v2", "TPU v2", 8 * GiB, _g(7.48), 22.5e12, 350e9, devices_per_chip=2),
        Generation("v3", "TPU v3", 16 * GiB, _g(15.48), 61.5e12, 450e9, devices_per_chip=2),
        Generation("v4", "TPU v4", 32 * GiB, _g(30.75), 275e12, 1228e9, clock_hz=1.05e9),
        Generation(
            "v5e", "TPU v5 lite", 16 * GiB, _g(15.75), 197e12, 819e9, clock_hz=1.5e9, ici_bandwidth=400e9, ici_ports=4
        ),
        Generation(
            "v5p", "TPU v5", 95 * GiB, 95 * GiB, 459e12, 2765e9, clock_hz=1.75e9, ici_bandwidth=1200e9, ici_ports=6
        ),
        Generation("v6e", "TPU v6 lite", 32 * GiB, _g(31.25), 918e12, 1640e9, ici_bandwidth=800e9, ici_ports=4),
    )
}


@dataclass(frozen=True)
class Device:
    """One kind of TPU VM (or this machine's CPU backend): its XLA devices and their memory."""

    name: str
    devices: int
    hbm_bytes: int  # per XLA device: what the planner budgets (the usable figure on a TPU)
    about: str
    generation: str = "cpu"
    legacy: bool = False  # no longer offered by Kaggle or Colab
    topology: str | None = None  # libtpu's name for its chips ("v5e:2x4"): what `memory --compile` compiles for
    host_bounds: tuple[int, int, int] = (1, 1, 1)  # chips per host along each axis of the topology

    @property
    def ici_in_bandwidth(self) -> float | None:
        """Bytes/s the slowest chip of the slice can receive over the interconnect: half the published
        bidirectional figure, over the ports it has neighbours on. A slice smaller than a whole pod (every VM
        in the catalog) has no wraparound: a corner chip has one neighbour along each axis longer than one
        (a v5e-8's 2x4: 2 of 4 ports). None on one chip, on the CPU backend and where the figure is unknown."""
        chip = GENERATIONS.get(self.generation)
        if chip is None or not chip.ici_bandwidth or not chip.ici_ports or not self.topology:
            return None
        axes = [int(n) for n in self.topology.split(":")[1].split("x")]
        neighbours = sum(1 for n in axes if n > 1)
        return chip.ici_bandwidth / 2 * neighbours / chip.ici_ports if neighbours else None

    @property
    def peak_flops(self) -> float | None:
        """Peak bf16 FLOP/s of one XLA device (None on the CPU backend)."""
        chip = GENERATIONS.get(self.generation)
        return chip.peak_flops if chip else None

    @property
    def hbm_bandwidth(self) -> float | None:
        """HBM bytes/s of one XLA device (None on the CPU backend)."""
        chip = GENERATIONS.get(self.generation)
        return chip.hbm_bandwidth if chip else None

    @property
    def clock_hz(self) -> float | None:
        """The TensorCore clock (None on the CPU backend and where it is not known)."""
        chip = GENERATIONS.get(self.generation)
        return chip.clock_hz if chip else None

    @property
    def hosts(self) -> int:
        """TPU VMs (hosts) the slice spans: one for a single VM."""
        return max(1, self.devices // math.prod(self.host_bounds))


def _vm(
    name: str, generation: str, devices: int, where: str = "", legacy: bool = False, chips: str = "", host: str = ""
) -> Device:
    """A TPU VM or pod slice; ``chips`` is its topology's shape ("4x4"), ``host`` one host's share ("2x4")."""
    g = GENERATIONS[generation]
    unit = "cores" if g.devices_per_chip > 1 else ("chip" if devices == 1 else "chips")
    about = f"TPU {name}: {devices} {unit} x {g.hbm_bytes // GiB} GiB{where}"
    dims = [int(d) for d in (host or chips).split("x")] if (host or chips) else [devices]
    bounds = (*dims, *[1] * (3 - len(dims)))
    topology = f"{generation}:{chips}" if chips else None
    return Device(name, devices, g.usable_bytes, about, generation, legacy, topology, bounds)  # type: ignore[arg-type]


DEVICES = {
    d.name: d
    for d in (
        _vm("v5e-1", "v5e", 1, " (Colab's free TPU)", chips="1x1"),
        _vm("v5e-4", "v5e", 4, chips="2x2"),
        _vm("v5e-8", "v5e", 8, " (Kaggle's free TPU)", chips="2x4"),
        _vm("v6e-1", "v6e", 1, chips="1x1"),
        _vm("v6e-4", "v6e", 4, chips="2x2"),
        _vm("v6e-8", "v6e", 8, chips="2x4"),
        _vm("v5e-16", "v5e", 16, " (a pod slice: 2 hosts of 8)", chips="4x4", host="2x4"),
        _vm("v5e-32", "v5e", 32, " (a pod slice: 4 hosts of 8)", chips="4x8", host="2x4"),
        _vm("v5e-64", "v5e", 64, " (a pod slice: 8 hosts of 8)", chips="8x8", host="2x4"),
        _vm("v6e-16", "v6e", 16, " (a pod slice: 2 hosts of 8)", chips="4x4", host="2x4"),
        _vm("v6e-32", "v6e", 32, " (a pod slice: 4 hosts of 8)", chips="4x8", host="2x4"),
        _vm("v6e-64", "v6e", 64, " (a pod slice: 8 hosts of 8)", chips="8x8", host="2x4"),
        # libtpu's compile-only v4 topologies count TensorCores (v4:2x2x4 shows 32 devices): none given.
        _vm("v4-32", "v4", 16, " (a pod slice: 4 hosts of 4)", host="2x2x1"),
        _vm("v4-8", "v4", 4),  # libtpu's compile-only v4:2x2x1 shows 8 devices (one per core), a v4-8 runs 4
        _vm("v5p-8", "v5p", 4, chips="2x2x1"),
        _vm("v3-8", "v3", 8, " (legacy: Kaggle's TPU until 2025)", legacy=True),
        _vm("v2-8", "v2", 8, " (legacy: Colab's TPU until September 2025)", legacy=True),
    )
}
TARGETS = (*DEVICES, "cpu")


def find_device(name: str, cpu_devices: int, host_ram: int) -> Device:
    """A known device by name; ``cpu`` is ``host_ram`` (the caller reads the machine's: ``machine.host_memory``)
    split over ``runtime.num_cpu_devices``."""
    if name == "cpu":
        return Device("cpu", cpu_devices, host_ram // cpu_devices, f"CPU backend: {cpu_devices} devices")
    if name not in DEVICES:
        raise UserError(f"--target: unknown device {name!r}; known devices: {', '.join(TARGETS)}")
    return DEVICES[name]


def device_for(generation: str, xla_devices: int) -> Device | None:
    """The catalog's VM with this chip generation and XLA device count (None when it has none)."""
    for device in DEVICES.values():
        if device.generation == generation and device.devices == xla_devices:
            return device
    return None


def generation_of(kind: str) -> Generation | None:
    """The chip generation a device kind names: PJRT's ("TPU v5 lite") or a short one ("v5e", "TPU v6e")."""
    text = kind.lower().removeprefix("tpu").strip()
    for g in GENERATIONS.values():
        if text in (g.name, g.kind.lower().removeprefix("tpu").strip()):
            return g
    return None
