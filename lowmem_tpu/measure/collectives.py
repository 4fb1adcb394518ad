"""What the interconnect carries in one step: every collective of the optimized program, counted once per run.

The TPU compiler writes one logical collective several times: an all-gather it splits into phases
(``async_collective_fusion``, each phase a fused computation holding the same all-gather) keeps one
``channel_id`` across the copies, and an asynchronous ``*-start``/``*-done`` pair is one transfer. So each
channel is counted once, where it is first met, times the trip counts of the loops around it (a windowed
einsum's collective-permutes run once per trip).

What one chip receives per run, for a collective over a group of ``n`` chips moving ``B`` bytes (the whole
gathered array, the whole array reduced): all-gather and reduce-scatter ``(n - 1) / n x B`` (a ring's
share), all-reduce twice that (a reduce-scatter then an all-gather), all-to-all ``(n - 1) / n x B``,
collective-permute ``B`` (each chip sends its block to one other). The same bytes leave each chip.
These are the algorithms' floors: the time they take at the interconnect's bandwidth is a lower bound,
which the step estimate says (``measure.tpu_report``).

Pure text, as :mod:`lowmem_tpu.measure.hlo_cost`, whose parser it shares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lowmem_tpu.measure.hlo_text import ITEMSIZE, Instruction, arrays, branches, parse, trip_count

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


@dataclass(frozen=True)
class Collective:
    """One logical collective of a step: its kind, the bytes it moves (``whole``: the gathered or reduced
    array), the chips in its group, and how many times a step runs it."""

    kind: str
    whole: int
    group: int
    runs: int
    dtype: str = ""  # the element type of the array moved (a quantized base's all-gathers move u8)

    @property
    def received(self) -> float:
        """Bytes one chip receives each run (and sends: the algorithms are symmetric)."""
        if self.kind == "collective-permute":
            return float(self.whole)
        if self.group <= 1:
            return 0.0
        share = (self.group - 1) / self.group * self.whole
        return 2 * share if self.kind == "all-reduce" else share


def kind_of(instruction: Instruction) -> str | None:
    """The collective an instruction starts or is (a ``*-done`` is none: its ``*-start`` is counted)."""
    op = instruction.op.removesuffix("-start")
    return op if op in KINDS and not instruction.op.endswith("-done") else None


def _bytes(type_text: str) -> int:
    return sum(math.prod(dims) * ITEMSIZE[dtype] for dtype, dims, _ in arrays(type_text))


def _dtype(type_text: str) -> str:
    found = arrays(type_text)
    return max(found, key=lambda a: math.prod(a[1]) * ITEMSIZE[a[0]])[0] if found else ""


def moved(instruction: Instruction, scope: dict[str, Instruction], kind: str) -> int:
    """The whole array a collective moves: an all-gather's result, a reduction's operands, a permute's block.

    An asynchronous start's type is a tuple of its operands, its results and its context scalars: what the
    operands are is read from the operands themselves."""
    operands = sum(_bytes(scope[name].type) for name in instruction.operands if name in scope)
    result = _bytes(instruction.type)
    if instruction.op.endswith("-start"):
        result = max(0, result - operands)  # (operands, results, contexts): contexts are a few bytes
    if kind in ("reduce-scatter", "all-reduce"):
        return operands or result
    if kind == "collective-permute":
        return operands or result
    return result


def group_size(attributes: str, chips: int) -> int:
    """The chips in one replica group (``{{0,1,...}}`` or the iota form ``[groups,size]<=[...]``); all when empty."""
    listed = _GROUPS.search(attributes)
    if listed:
        return max(len([d for d in g.split(",") if d]) for g in re.findall(r"\{([\d,]*)\}", listed.group(1)))
    iota = _IOTA_GROUPS.search(attributes)
    return int(iota.group(2)) if iota else chips


def collectives(text: str, chips: int) -> list[Collective]:
    """Every logical collective of an optimized HLO text with the times a step runs it, one chip's view."""
    computations, entry = parse(text)
    found: dict[str, Collective] = {}

    def visit(name: str, runs: int) -> None:
        scope = computations.get(name, {})
        for instruction in scope.values():
            kind = kind_of(instruction)
            if kind is not None:
                channel = _CHANNEL.search(instruction.attributes)
                key = f"channel {channel.group(1)}" if channel else f"{name}/{instruction.name}"
                if key not in found:
                    group = group_size(instruction.attributes, chips)
                    whole = moved(instruction, scope, kind)
                    found[key] = Collective(kind, whole, group, runs, _dtype(instruction.type))
            if instruction.op == "while":
                trips = trip_count(computations, scope, instruction) or 1
                for called in instruction.called("body"):
                    visit(called, runs * trips)
            elif instruction.op in ("fusion", "call", "conditional", "async-start"):
                for called in (*instruction.called("calls"), *instruction.called("to_apply"), *branches(instruction)):
                    visit(called, runs)

    visit(entry, 1)
    return list(found.values())


def received_by_kind(found: list[Collective]) -> dict[str, float]:
    """Bytes one chip receives in a step, per kind of collective."""
    totals: dict[str, float] = {}
    for c in found:
        totals[c.kind] = totals.get(c.kind, 0.0) + c.received * c.runs
    return {kind: totals[kind] for kind in KINDS if kind in totals}


def gathered_by_dtype(found: list[Collective]) -> dict[str, int]:
    """Bytes the all-gathers of a step produce on one chip (each logical gather once per run), by element type."""
    totals: dict[str, int] = {}
    for c in found:
        if c.kind == "all-gather":
            totals[c.dtype] = totals.get(c.dtype, 0) + c.whole * c.runs
    return dict(sorted(totals.items()))
