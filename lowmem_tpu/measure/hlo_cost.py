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

ITEMSIZE = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](?:\{([^}]*)\})?")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SPACE = re.compile(r"S\((\d+)\)")
_SLICES = ("slice", "dynamic-slice")
_ALIASED = re.compile(r"\{(\d*)(?:,\d+)*\}: \((\d+), \{[\d,]*\}\)")
# Instructions that move or compute nothing in HBM themselves (views, control, loop plumbing).
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call", "conditional",
    "partition-id", "replica-id", "after-all", "opt-barrier", "iota",
}  # fmt: skip


@dataclass(frozen=True)
class Instruction:
    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    literal: str  # between the parentheses: a constant's value
    attributes: str  # everything after the operands: called computations, backend_config, ...

    @property
    def cycles(self) -> int:
        found = _CYCLES.search(self.attributes)
        return int(found.group(1)) if found else 0

    def called(self, kind: str) -> list[str]:
        return [name for k, name in _CALLS.findall(self.attributes) if k == kind]


Computations = dict[str, dict[str, Instruction]]


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


def parse(text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
    """The module's computations (name -> instructions by name, in order) and its entry's name."""
    computations: dict[str, dict[str, Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(1), {})
                entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found:
            name, type_, op, rest = found.groups()
            args, _, attributes = rest.partition(")")
            operands = tuple(re.findall(r"%([\w.\-]+)", args))
            current[name] = Instruction(name, type_, op, operands, args, attributes)  # type: ignore[index]
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(element type, dims, memory space) of every array in an HLO type (a tuple's too)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(type_text):
        if dtype not in ITEMSIZE:
            continue
        space = _SPACE.search(layout or "")
        out.append((dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return out


def _array_bytes(array: tuple[str, tuple[int, ...], int]) -> int:
    dtype, dims, space = array
    # Scalars (loop counters, indices) live in the scalar unit's memory, not HBM.
    return math.prod(dims) * ITEMSIZE[dtype] if space == 0 and dims else 0


def hbm_bytes(type_text: str) -> int:
    return sum(_array_bytes(a) for a in arrays(type_text))


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


def _literal(scope: dict[str, Instruction], name: str) -> int | None:
    """A scalar integer constant, through copies, bitcasts and converts."""
    for _ in range(16):
        instruction = scope.get(name)
        if instruction is None:
            return None
        if instruction.op == "constant":
            return int(instruction.literal) if re.fullmatch(r"-?\d+", instruction.literal.strip()) else None
        if instruction.op not in ("copy", "bitcast", "convert") or not instruction.operands:
            return None
        name = instruction.operands[0]
    return None


def trip_count(
    computations: dict[str, dict[str, Instruction]], scope: dict[str, Instruction], loop: Instruction
) -> int | None:
    """How many times ``loop`` runs its body: a counter starting at a constant, stepped by a constant,
    compared ``LT`` with a constant (the form XLA's loops and the windowed einsums have)."""
    condition, body = loop.called("condition"), loop.called("body")
    if not condition or not body or condition[0] not in computations or body[0] not in computations:
        return None
    cond, step_scope = computations[condition[0]], computations[body[0]]
    root = list(cond.values())[-1]
    if root.op != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
        return None
    counter = cond.get(root.operands[0])
    index = _tuple_index(counter) if counter is not None and counter.op == "get-tuple-element" else None
    limit = _literal(cond, root.operands[1])
    init = scope.get(loop.operands[0]) if loop.operands else None
    if index is None or limit is None or init is None or init.op != "tuple" or index >= len(init.operands):
        return None
    start = _literal(scope, init.operands[index])
    body_root = list(step_scope.values())[-1]
    if start is None or body_root.op != "tuple" or index >= len(body_root.operands):
        return None
    update = step_scope.get(body_root.operands[index])
    if update is None or update.op != "add":
        return None
    step = next((s for s in (_literal(step_scope, n) for n in update.operands) if s is not None), None)
    if not step or step <= 0:
        return None
    return max(0, -(-(limit - start) // step))


def _tuple_index(instruction: Instruction) -> int | None:
    found = re.search(r"\bindex=(\d+)", instruction.attributes)
    return int(found.group(1)) if found else None


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


def branches(instruction: Instruction) -> list[str]:
    found = _BRANCHES.search(instruction.attributes)
    return re.findall(r"%([\w.\-]+)", found.group(1)) if found else []


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
    return float(read + sum(_array_bytes(a) for a in written))


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
            sliced = sum(math.prod(dims) * ITEMSIZE[dtype] for u in users for dtype, dims, _ in arrays(u.type))
            return min(whole, sliced)
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
