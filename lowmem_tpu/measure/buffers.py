"""Reading the XLA compiler's own memory figures: buffer assignments dumped with ``--xla_dump_to``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lowmem_tpu.errors import UserError

# Without the CPU flag the CPU backend keeps every layer's gathered weights live at once
# (docs/memory.md), so FSDP and checkpointing would seem to save little. libtpu does not
# know --xla_cpu_* flags, so a TPU gets only the dump flags.
DUMP_FLAGS = "--xla_dump_to={dir} --xla_dump_hlo_pass_re=NONE"
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def dump_flags(directory: Path, platform: str) -> str:
    """XLA_FLAGS that make the compiler write its buffer assignment for each program into ``directory``."""
    flags = DUMP_FLAGS.format(dir=directory)
    return f"{flags} {CPU_SCHEDULER_FLAG}" if platform == "CPU" else flags


_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.M)
_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(.*)$", re.M)
_LIVE = re.compile(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes", re.M)
# The TPU compiler's refusal, e.g. "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of
# memory in memory space hbm. Used 21.95G of 15.48G hbm. Exceeded hbm capacity by 6.47G."
_EXHAUSTED = re.compile(r"Ran out of memory in memory space (\w+)\. Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)")
# The TPU runtime's, when a program the compiler accepted cannot get its buffers when it runs (other
# live tensors, fragmentation): "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to
# allocate 129.50M. That was not possible. There are 78.17M free.; (0x0x0_HBM0)", or "Attempting to
# reserve 10.51G at the bottom of memory. That was not possible. There are 8.97G free, ...".
_RUNTIME = re.compile(r"Attempting to (?:allocate|reserve) ([\d.]+)([KMGT]?).*?There are ([\d.]+)([KMGT]?) free")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class OutOfMemory:
    """A RESOURCE_EXHAUSTED for a program: what it needs and what the device has.

    ``when`` is "compile" (the compiler's refusal: the program's needs against the chip's capacity) or
    "run" (the runtime could not allocate a buffer: the request against what was free then).
    """

    memory_space: str  # "hbm", or "vmem" (a kernel's on-chip scratch)
    needed_bytes: int
    capacity_bytes: int
    message: str
    when: str = "compile"

    def describe(self) -> str:
        need, have = f"{self.needed_bytes / 2**30:.2f} GiB", f"{self.capacity_bytes / 2**30:.2f} GiB"
        if self.when == "run":
            return f"does not fit: running the step, the TPU could not allocate {need} of HBM ({have} free)"
        if self.memory_space != "hbm":
            return (
                f"does not fit: a kernel's on-chip scratch ({self.memory_space.upper()}, not HBM) needs {need} of "
                f"{have}: use smaller kernel blocks or a shorter data.max_length"
            )
        return f"does not fit: the compiler asks for {need} of {have} hbm"


def out_of_memory(error: str) -> OutOfMemory | None:
    """The figures of a RESOURCE_EXHAUSTED error, at compile or at run time (None when ``error`` is something else)."""
    compiled, ran = _EXHAUSTED.search(error), _RUNTIME.search(error)
    if compiled is None and ran is None:
        return None
    key = "Ran out of memory" if compiled else "Attempting to"
    line = next((part for part in error.splitlines() if key in part), error).strip()[:400]
    if compiled is not None:
        space, used, used_unit, limit, limit_unit = compiled.groups()
        return OutOfMemory(space, int(float(used) * _UNITS[used_unit]), int(float(limit) * _UNITS[limit_unit]), line)
    asked, asked_unit, free, free_unit = ran.groups()  # type: ignore[union-attr]
    needed, left = int(float(asked) * _UNITS[asked_unit]), int(float(free) * _UNITS[free_unit])
    return OutOfMemory("hbm", needed, left, line, when="run")


@dataclass(frozen=True)
class CompilerFigures:
    """One device's partition of a compiled program, from XLA's buffer assignment."""

    total_bytes: int  # every allocation: entry parameters + outputs + the temporary arena
    peak_live_bytes: int  # the most bytes live at one point of the schedule
    parameter_bytes: int  # entry parameters (weights, optimizer state, the batch)
    temp_bytes: int  # the preallocated temporary arena
    output_bytes: int  # outputs that do not reuse a parameter's buffer
    module: str  # dump file name of the program


def parse_buffer_assignment(path: Path) -> CompilerFigures:
    """Figures of one ``*buffer-assignment.txt`` that XLA wrote with ``--xla_dump_to``."""
    text = path.read_text()
    total = _TOTAL.search(text)
    if total is None:
        raise ValueError(f"{path}: no 'Total bytes used' line")
    peak = _PEAK.search(text)
    parameter = temp = output = 0
    for size, rest in _ALLOCATION.findall(text):
        if " parameter " in rest:
            parameter += int(size)
        elif "preallocated-temp" in rest:
            temp += int(size)
        elif "live-out" in rest:
            output += int(size)
    return CompilerFigures(
        total_bytes=int(total.group(1)),
        peak_live_bytes=int(peak.group(1).replace(" ", "")) if peak else 0,
        parameter_bytes=parameter,
        temp_bytes=temp,
        output_bytes=output,
        module=re.split(r"[._](?:cpu_|tpu_)?after_optimizations", path.name)[0],
    )


def optimized_hlo(buffer_assignment: Path) -> Path:
    """The optimized HLO text that XLA dumped beside a buffer assignment."""
    return Path(str(buffer_assignment).replace("-buffer-assignment.txt", ".txt"))


def live_at_peak(buffer_assignment: Path) -> list[tuple[str, str, int]]:
    """(instruction, shape, bytes) of every buffer live at the program's peak, largest first.

    The shapes come from the optimized HLO dumped beside the buffer assignment.
    """
    text = buffer_assignment.read_text()
    start = text.find("(peak):")
    if start < 0:
        return []
    section = text[start : text.find("Stack trace breakdown", start)]
    hlo_path = optimized_hlo(buffer_assignment)
    hlo = hlo_path.read_text() if hlo_path.exists() else ""
    shapes = {m.group(1): m.group(2) for m in re.finditer(r"%(\S+) = (\S+?)\{", hlo)}
    live = [(name, shapes.get(name, "?"), int(size)) for name, size in _LIVE.findall(section)]
    return sorted(live, key=lambda item: -item[2])


def largest_program(paths: list[Path]) -> CompilerFigures:
    """The program that uses the most memory among dumped buffer assignments (the training step)."""
    figures = [parse_buffer_assignment(p) for p in paths]
    if not figures:
        raise UserError("the compiler wrote no buffer assignment: was XLA_FLAGS set before torch_xla started?")
    return max(figures, key=lambda f: f.total_bytes)


@dataclass(frozen=True)
class HbmAllocations:
    """A TPU buffer assignment split by memory space: colour 0 is HBM, 5 the host, the others on-chip memory."""

    parameters: int  # HBM allocations of entry parameters
    outputs: int  # HBM allocations live out of the program that are not parameters
    temporaries: int  # every other HBM allocation (the temporary arena, constants, thread-local)
    scratch: int  # on-chip: VMEM, SMEM, semaphores (layouts S(1) to S(4), S(6)), not HBM
    host: int = 0  # colour 5, layout S(5): pinned host memory (host offload's copies), not HBM


_COLOUR = re.compile(r"\bcolor (\d+)")
HOST_COLOUR = "5"  # XLA's Layout::kHostMemorySpace


def hbm_allocations(path: Path) -> HbmAllocations:
    """The HBM and on-chip split of a TPU ``*after_optimizations-buffer-assignment.txt``."""
    parameters = outputs = temporaries = scratch = host = 0
    for size, rest in _ALLOCATION.findall(path.read_text()):
        colour = _COLOUR.search(rest)
        if colour and colour.group(1) == HOST_COLOUR:
            host += int(size)
        elif colour and colour.group(1) != "0":
            scratch += int(size)
        elif " parameter " in rest:
            parameters += int(size)
        elif "live-out" in rest:
            outputs += int(size)
        else:
            temporaries += int(size)
    return HbmAllocations(parameters, outputs, temporaries, scratch, host)
