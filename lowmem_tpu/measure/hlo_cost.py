"""The step's cost as the TPU compiler sees it: its own cycle estimates, summed with loop trip counts.

libtpu writes, on every fusion, copy and broadcast of the program it generated code for (the
``after_codegen`` module), ``backend_config.window_config.estimated_cycles``: the cost its scheduler
works with. XLA's ``cost_analysis()`` counts a while loop's body once, and the TPU compiler turns a
weight shard's all-gather followed by its matmul into a windowed loop (2 trips on 8 chips), so the
sums here follow every loop ``trip`` times, with the trip count read off the loop itself (a counter
from a constant, a constant step, ``LT`` a constant bound).

- ``cycles``: the sum of ``estimated_cycles`` over what runs (divide by the chip's clock for seconds).
  Collectives (all-gather, collective-permute) and asynchronous copies carry no cycles: the compiler
  overlaps them with compute, and so does this sum.
- ``flops``: 2 x every matmul's (``convolution``/``dot``) multiply-adds, with trip counts.
- ``hbm_bytes``: bytes the executed instructions read and write in HBM (memory space 0; on-chip
  ``S(1)`` operands are not HBM traffic), logical sizes (tile padding not counted), with trip counts.
- Pallas kernels (``tpu_custom_call``) carry no cycles: they are listed with their HBM bytes, and
  ``measure.tpu_report.kernel_seconds`` costs them from their shapes.

Pure text: no jax or libtpu here (``measure.libtpu`` writes the text this reads).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cache

from lowmem_tpu.measure.hlo_text import (
    Computations,
    Instruction,
    array_bytes,
    arrays,
    branches,
    hbm_bytes,
    parse,
    trip_count,
)

_SLICES = ("slice", "dynamic-slice")
_ALIASED = re.compile(r"\{(\d*)(?:,\d+)*\}: \((\d+), \{[\d,]*\}\)")
# Instructions that move or compute nothing in HBM themselves (views, control, loop plumbing).
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call", "conditional",
    "partition-id", "replica-id", "after-all", "opt-barrier", "iota",
}  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    """A Pallas kernel (``tpu_custom_call``) in the step, per run: its HBM bytes, the flops its author
    declared (``pl.CostEstimate``, None when it has none) and its operands' dims."""

    name: str
    runs: int
    hbm_bytes: int
    flops: float | None
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StepCost:
    """One chip's step, summed over the optimized program with every loop's trip count."""

    cycles: int
    flops: float
    hbm_bytes: float
    loops: int  # while loops in the program
    loops_unresolved: int  # loops whose trip count could not be read (counted once)
    flops_once: float  # the flops with every loop body counted once (as XLA's cost analysis does)
    kernels: tuple[Kernel, ...] = field(default_factory=tuple)


def matmul_flops(instruction: Instruction, scope: dict[str, Instruction]) -> float:
    """2 x the multiply-adds of a ``convolution`` (a dot as the TPU compiler writes it) or a ``dot``."""
    out = arrays(instruction.type)
    operands = [scope.get(n) for n in instruction.operands[:2]]
    if not out or len(operands) < 2 or None in operands:
        return 0.0
    lhs, rhs = (arrays(o.type)[0][1] if arrays(o.type) else () for o in operands)  # type: ignore[union-attr]
    elements = math.prod(out[0][1])
    if instruction.op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
        dims = [int(k) for k in contracting.group(1).split(",") if k] if contracting else []
        return 2.0 * elements * math.prod(lhs[k] for k in dims) if all(k < len(lhs) for k in dims) else 0.0
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    if not labels or "i" not in labels.group(2) or len(labels.group(2)) != len(rhs) or len(labels.group(1)) != len(lhs):
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = _window(instruction.attributes)
    share = 1.0
    for k, label in enumerate(sorted(c for c in rhs_labels if c.isdigit())):
        n, m = lhs[lhs_labels.index(label)], out[0][1][out_labels.index(label)]
        w = rhs[rhs_labels.index(label)]
        settings = (window[key][k] if k < len(window[key]) else default for key, default in _WINDOW)
        share *= _taps(n, m, w, *settings) / m
    return 2.0 * elements * rhs[rhs_labels.index("i")] * share


_WINDOW = (("stride", 1), ("pad_low", 0), ("lhs_dilate", 1), ("rhs_dilate", 1))


def _window(attributes: str) -> dict[str, list[int]]:
    """A convolution's window: per spatial dimension its stride, low padding and dilations."""
    found = re.search(r"window=\{([^}]*)\}", attributes)
    fields = dict(part.split("=", 1) for part in found.group(1).split() if "=" in part) if found else {}
    return {
        "stride": [int(x) for x in fields.get("stride", "").split("x") if x],
        "pad_low": [int(p.split("_")[0]) for p in fields.get("pad", "").split("x") if p],
        "lhs_dilate": [int(x) for x in fields.get("lhs_dilate", "").split("x") if x],
        "rhs_dilate": [int(x) for x in fields.get("rhs_dilate", "").split("x") if x],
    }


@cache
def _taps(n: int, m: int, w: int, stride: int, pad: int, dilate: int, rhs_dilate: int) -> int:
    """Window positions, summed over the ``m`` outputs of one spatial dimension, that meet a real input
    element (not padding, not a hole of ``lhs_dilate``). The TPU compiler writes a batched matmul as a
    window of the batch's size over an input dilated by as much (one element met per output, not 128),
    and a windowed einsum's shard as a window of 2 over one element padded by one on each side."""
    if m * w > 4_000_000:  # not met in practice: the plain count
        return m * w
    last = (n - 1) * dilate
    met = 0
    for k in range(w):
        for o in range(m):
            q = o * stride + k * rhs_dilate - pad
            met += 0 <= q <= last and q % dilate == 0
    return met


@dataclass
class _Walk:
    """Sums over one module, each computation's figures computed once (per computation, not per call)."""

    computations: dict[str, dict[str, Instruction]]
    loops: int = 0
    unresolved: int = 0

    def __post_init__(self) -> None:
        self._memo: dict[tuple[str, bool], tuple[int, float, float]] = {}
        self._fused: dict[str, float] = {}

    def cost(self, name: str, trips: bool = True) -> tuple[int, float, float]:
        """(cycles, flops, HBM bytes) of one run of computation ``name``."""
        key = (name, trips)
        if key not in self._memo:
            self._memo[key] = self._cost(self.computations.get(name, {}), trips)
        return self._memo[key]

    def _cost(self, scope: dict[str, Instruction], trips: bool) -> tuple[int, float, float]:
        cycles, flops, traffic = 0, 0.0, 0.0
        for instruction in scope.values():
            cycles += instruction.cycles
            op = instruction.op
            if op in ("convolution", "dot"):
                flops += matmul_flops(instruction, scope)
            if op == "fusion":
                for called in instruction.called("calls"):
                    flops += self._fused_flops(called)
            elif op == "while":
                n = trip_count(self.computations, scope, instruction) if trips else 1
                if n is None:
                    n = 1
                    self.unresolved += trips
                self.loops += trips
                for called in (*instruction.called("body"), *instruction.called("condition")):
                    c, f, b = self.cost(called, trips)
                    cycles, flops, traffic = cycles + n * c, flops + n * f, traffic + n * b
            elif op in ("call", "conditional"):
                names = instruction.called("to_apply") or branches(instruction)
                parts = [self.cost(called, trips) for called in names]
                if parts:  # a conditional runs one branch: the costliest is counted
                    c, f, b = max(parts)
                    cycles, flops, traffic = cycles + c, flops + f, traffic + b
            traffic += _traffic(instruction, scope, self.computations)
        return cycles, flops, traffic

    def _fused_flops(self, name: str) -> float:
        if name not in self._fused:
            scope = self.computations.get(name, {})
            total = 0.0
            for instruction in scope.values():
                if instruction.op in ("convolution", "dot"):
                    total += matmul_flops(instruction, scope)
                elif instruction.op == "fusion":
                    total += sum(self._fused_flops(called) for called in instruction.called("calls"))
            self._fused[name] = total
        return self._fused[name]


def in_place(instruction: Instruction) -> tuple[set[int | None], set[int]]:
    """The outputs (a tuple's index, None for the whole) an instruction updates in place and the operands
    they alias (``output_to_operand_aliasing``)."""
    pairs = _ALIASED.findall(instruction.attributes)
    return {int(out) if out else None for out, _ in pairs}, {int(operand) for _, operand in pairs}


def _traffic(instruction: Instruction, scope: dict[str, Instruction], computations: Computations) -> float:
    """HBM bytes an executed instruction reads and writes (an asynchronous start: its source and destination).

    A fusion's buffer updated in place (an output aliased to an operand: a windowed all-gather's destination, a
    dynamic-update-slice's) is touched only where it is updated, not read and written whole on every trip of
    its loop, and an operand the fusion only slices is read where it is sliced; both are left out or counted
    by their slices (Open Llama 3B at 2 layers on v5e-8: 35% of the bytes counted whole). A Pallas kernel's
    aliased output is its own to write whole: counted."""
    op = instruction.op
    if op in _NO_TRAFFIC or op.endswith("-done"):
        return 0.0
    outputs, operands = in_place(instruction) if op == "fusion" else (set(), set())
    read = sum(
        _read(instruction, i, scope[n], computations)
        for i, n in enumerate(instruction.operands)
        if n in scope and i not in operands
    )
    if None in outputs:
        return float(read)
    written = arrays(instruction.type)
    written = written[:1] if op.endswith("-start") else [a for i, a in enumerate(written) if i not in outputs]
    return float(read + sum(array_bytes(a) for a in written))


def _read(instruction: Instruction, index: int, operand: Instruction, computations: Computations) -> int:
    """HBM bytes a fusion reads of its operand ``index``: the slices it takes where it only slices it."""
    whole = hbm_bytes(operand.type)
    if not whole or instruction.op != "fusion":
        return whole
    for called in instruction.called("calls"):
        fused = computations.get(called, {})
        parameter = next((i for i in fused.values() if i.op == "parameter" and i.literal == str(index)), None)
        users = [i for i in fused.values() if parameter and parameter.name in i.operands]
        if users and all(u.op in _SLICES and u.operands[0] == parameter.name for u in users):
            return min(whole, sum(hbm_bytes(u.type) for u in users))
    return whole


def step_cost(text: str) -> StepCost:
    """The cost of one run of the module's entry computation (an ``after_codegen`` HLO text)."""
    computations, entry = parse(text)
    walk = _Walk(computations)
    cycles, flops, traffic = walk.cost(entry)
    loops, unresolved = walk.loops, walk.unresolved
    _, flops_once, _ = walk.cost(entry, trips=False)
    return StepCost(cycles, flops, traffic, loops, unresolved, flops_once, tuple(kernels(computations, entry)))


def kernels(computations: dict[str, dict[str, Instruction]], entry: str) -> list[Kernel]:
    """The Pallas kernels of the program, alike ones (name, shapes) together with how often a step runs them."""
    found: dict[tuple, Kernel] = {}

    def visit(name: str, times: int) -> None:
        scope = computations.get(name, {})
        for instruction in scope.values():
            if instruction.op == "custom-call" and 'custom_call_target="tpu_custom_call"' in instruction.attributes:
                typed = [arrays(scope[n].type) for n in instruction.operands if n in scope]
                shapes = tuple(operand[0][1] for operand in typed if operand)
                declared = _DECLARED.search(instruction.attributes)
                kernel = Kernel(
                    kernel_name(instruction.attributes),
                    times,
                    int(_traffic(instruction, scope, computations)),
                    float(declared.group(1)) if declared else None,
                    shapes,
                )
                key = (kernel.name, shapes, kernel.hbm_bytes)
                old = found.get(key)
                found[key] = kernel if old is None else Kernel(**{**kernel.__dict__, "runs": old.runs + times})
            elif instruction.op == "while":
                n = trip_count(computations, scope, instruction) or 1
                for called in instruction.called("body"):
                    visit(called, times * n)
            elif instruction.op in ("call", "conditional"):
                for called in instruction.called("to_apply") or branches(instruction):
                    visit(called, times)

    visit(entry, 1)
    return list(found.values())


_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')
_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]+)"')
_KERNEL = re.compile(rb"([A-Za-z_][A-Za-z0-9_]*_kernel[A-Za-z0-9_]*)")


def kernel_name(attributes: str) -> str:
    """The Python function a Pallas kernel was written as (in its serialized Mosaic body), e.g.
    ``_flash_attention_dkv_kernel``; "pallas kernel" when the body names none."""
    import base64
    import binascii

    body = _BODY.search(attributes)
    try:
        names = _KERNEL.findall(base64.b64decode(body.group(1))) if body else []
    except (binascii.Error, ValueError):
        names = []
    return names[0].decode() if names else "pallas kernel"
