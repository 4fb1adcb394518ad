"""The TPU compiler's optimized program as text: its computations, instructions, arrays and loop trip counts.

``measure.hlo_cost`` (the step's cycles, flops, HBM bytes and kernels) and ``measure.collectives`` (what the
interconnect carries) read programs through this. Pure text: no jax or libtpu here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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


def array_bytes(array: tuple[str, tuple[int, ...], int]) -> int:
    dtype, dims, space = array
    # Scalars (loop counters, indices) live in the scalar unit's memory, not HBM.
    return math.prod(dims) * ITEMSIZE[dtype] if space == 0 and dims else 0


def hbm_bytes(type_text: str) -> int:
    return sum(array_bytes(a) for a in arrays(type_text))


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


def branches(instruction: Instruction) -> list[str]:
    found = _BRANCHES.search(instruction.attributes)
    return re.findall(r"%([\w.\-]+)", found.group(1)) if found else []
