"""``lowmem-tpu memory --compile``: the TPU compiler's verdict on the recipe's real step, without a TPU.

Two subprocesses, one per XLA: :mod:`lowmem_tpu.measure.child` ``trace`` traces the steady training
step on as many CPU devices as the target has chips, with placeholders for every weight and
optimizer tensor (:mod:`lowmem_tpu.measure.trace`), and leaves the program torch_xla hands PJRT;
:mod:`lowmem_tpu.measure.libtpu` compiles that program with libtpu's compile-only client for the
target's topology. The figures are the TPU compiler's for one chip's partition: what a TPU would
allocate for this program, not a run (nothing executes; a real run also holds the runtime's own
buffers, and XLA may schedule a program it compiled on a TPU differently at run time).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES, Device
from lowmem_tpu.console import size
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import host_memory, meminfo
from lowmem_tpu.measure.buffers import OutOfMemory, hbm_allocations, out_of_memory
from lowmem_tpu.memory.tiles import tpu_shard_bytes

EXTRA = 'pip install -c constraints.txt -e ".[compiler]"'
TRACE_FLAGS = "--xla_dump_to={dir} --xla_dump_hlo_pass_re=NONE --xla_dump_hlo_as_proto --xla_dump_hlo_as_text"


# What a fitting program leaves free of the chip's usable HBM (the compiler's own ceiling, 15.75 GiB on v5e):
# TPU runtimes refuse a program that finds no contiguous block beside the arguments ("Attempting to reserve
# ... at the bottom of memory. That was not possible") and reserve memory of their own at load.
MARGIN = 2**30


@dataclass(frozen=True)
class TpuCompile:
    """The TPU compiler's figures for one chip's partition of the recipe's steady step (bytes)."""

    device: str
    topology: str
    chips: int
    capacity: int  # the chip's usable HBM
    libtpu: str
    kind: str
    trace_seconds: float
    compile_seconds: float
    host_peak_rss_bytes: int
    placeholders: int
    donated: int
    arguments: int = 0
    outputs: int = 0
    aliased: int = 0
    temporaries: int = 0  # HBM only (colour 0 of the buffer assignment)
    scratch: int = 0  # on-chip memory (VMEM, SMEM, ...): the other colours, not HBM
    host: int = 0  # pinned host memory the program uses (layout S(5)), not HBM
    # With accumulation: the optimizer state and master weights that stay in HBM beside the
    # micro-batch's program (which does not take them), by the shard rule and the TPU's tiles.
    resident: int = 0
    idle: int = 0  # weights in HBM the step never reads (a multimodal checkpoint's vision tower on text)
    kernels: int = 0  # Pallas kernels (tpu_custom_call) in the traced program
    generated_code: int = 0
    cost: dict[str, float] = field(default_factory=dict)
    compiler_stats: dict[str, int] = field(default_factory=dict)  # get_compiled_memory_stats(), as reported
    # Bytes the optimized program's all-gathers produce on one chip in a step, by element type: each logical
    # gather once (measure.collectives), times its loop's trips: a quantized base gathers its packed u8
    # weights, never bf16/f32 ones.
    gathered: dict[str, int] = field(default_factory=dict)
    # The step's cost summed over the optimized program with loop trip counts (measure.hlo_cost):
    # cycles, flops, hbm_bytes, flops_once (loop bodies once, as cost_analysis), loops, kernels; and
    # ``received``, the bytes one chip receives over the interconnect by kind of collective.
    step: dict[str, Any] = field(default_factory=dict)
    refused: OutOfMemory | None = None
    error: str | None = None
    extrapolated_from: tuple[int, ...] = ()  # layer counts compiled, when the whole step was too big to compile here
    # An extrapolated figure's uncertainty: the largest share by which the line missed a whole compile of
    # its kind of step (measure.tpu_layers.LINE_ERROR); 0 for a step compiled whole.
    line_error: float = 0.0

    @property
    def needed(self) -> int:
        """What the chip must hold at the step's peak: arguments + outputs - aliased + temporaries
        (+ what stays resident beside a micro-batch's program, + weights the step never reads)."""
        beside = self.resident + self.idle
        if self.refused is not None:
            return self.refused.needed_bytes + beside
        return self.arguments + self.outputs - self.aliased + self.temporaries + beside

    @property
    def held(self) -> int:
        """What the chip holds for the program: its buffers, its generated code (in HBM too) and, for an
        extrapolated figure, the line's error on them."""
        return self.needed + self.generated_code + round(self.line_error * self.needed)

    @property
    def free(self) -> int:
        """The usable HBM left beside the program (negative: over)."""
        return self.capacity - self.held

    @property
    def fits(self) -> bool:
        """The program fits with :data:`MARGIN` of the chip's usable HBM free: a runtime loads a program only
        where one contiguous block holds it beside the live buffers, and holds memory of its own."""
        return self.refused is None and self.error is None and self.free >= MARGIN


def compile_target(name: str) -> Device:
    """The catalog device to compile for; exit 2 naming the ones with a topology libtpu knows."""
    known = [d.name for d in DEVICES.values() if d.topology]
    device = DEVICES.get(name)
    if device is None or device.topology is None:
        why = f"unknown device {name!r}" if device is None else f"libtpu's compile-only client has no {name}"
        raise UserError(f"--target: {why}; --compile knows {', '.join(known)}")
    return device


def require_compiler() -> None:
    """jax and libtpu, the compile-only client: the ``compiler`` extra (in ``dev`` too)."""
    missing = [name for name in ("jax", "jaxlib", "libtpu") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"--compile needs the TPU compiler ({', '.join(missing)} not installed): {EXTRA}")


@dataclass(frozen=True)
class TracedStep:
    """The steady step torch_xla handed the CPU backend, ready for the TPU compiler."""

    request: dict[str, Any]  # what measure.libtpu reads: the module, the topology, the placeholders
    trace_seconds: float
    host_peak_rss_bytes: int
    key: str  # the program, the target, libtpu and our compile step: equal keys compile alike
    kernels: int = 0  # Pallas kernels (tpu_custom_call) in the program
    resident: int = 0  # per chip: what stays in HBM beside the program without being its argument
    idle: int = 0  # per chip: weights in HBM the step never reads (a vision tower when training on text)


def trace_step(recipe: Recipe, device: Device, work: Path, timeout: float = 3600) -> TracedStep:
    """Trace the recipe's steady step on ``device.devices`` CPU devices, weights as placeholders, into ``work``."""
    from lowmem_tpu.measure.local import spawn_step, with_user_flags

    n = device.devices  # the [scan] extra: the command's preflight (a child without it says so, as a UserError)
    dump = work / "trace"
    dump.mkdir(parents=True, exist_ok=True)
    # Checked as the TPU run it stands for (flash is a TPU field); the child traces it on the CPU.
    overrides = ["runtime.device=tpu", "runtime.compile_cache_dir=null"]
    env = {
        "PJRT_DEVICE": "CPU",
        "PJRT_LOCAL_PROCESS_RANK": "0",  # the guard of xla.runtime.refuse_execution acts on rank 0 only
        "CPU_NUM_DEVICES": str(n),
        "LOWMEM_TRACE_CPU_DEVICES": str(n),
        "JAX_PLATFORMS": "cpu",  # flash's kernel is traced by jax: never let it reach for a TPU
        # A Pallas kernel's body carries its source locations: file names without their folders, so that
        # the same program traced in another checkout or environment has the same key.
        "JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX": ".*/",
        # Python's string hashes fixed: a set of strings iterates in one order (Gemma 4 computes its rotary
        # tables over ``set(layer_types)``, and their order is the program's output order)
        "PYTHONHASHSEED": "0",
        "XLA_FLAGS": with_user_flags(TRACE_FLAGS.format(dir=dump)),
        "LOWMEM_DUMP_DIR": str(dump),
        # torch_xla wraps a program's arguments into one tuple past 3200 of them (a 70B model's step has
        # 4,600+): the same memory, but the placeholders' shardings and the donors are set per argument.
        "XLA_PARAMETER_WRAPPING_THREADSHOLD": str(10**9),
    }
    started = time.perf_counter()
    traced = spawn_step("trace", recipe, overrides, 1, env, timeout)
    accumulating = recipe.train.gradient_accumulation_steps > 1
    request = {
        "module": traced["module"],
        "module_text": traced["module_text"],
        "topology": device.topology,
        "host_bounds": list(device.host_bounds),
        "devices": n,
        # With accumulation the program is the first micro-batch's: the model's placeholders only.
        "placeholders": traced["model_placeholders" if accumulating else "placeholders"],
        "strategy": recipe.sharding.strategy,
    }
    resident = 0
    if accumulating:
        strategy = recipe.sharding.strategy
        resident = sum(tpu_shard_bytes(shape, itemsize, strategy, n) for shape, itemsize in traced["resident"])
    digest = hashlib.sha256(Path(traced["module"]).read_bytes())
    digest.update(json.dumps({k: v for k, v in request.items() if not k.startswith("module")}).encode())
    digest.update(compiler_fingerprint())
    digest.update(_package_version("libtpu").encode() + _package_version("jax").encode())
    text = Path(traced["module_text"]).read_text()
    if "rng-bit-generator" in text:  # the only op our libtpu flags change
        from lowmem_tpu.xla.runtime import with_libtpu_flags

        digest.update(with_libtpu_flags(os.environ.get("LIBTPU_INIT_ARGS", "")).encode())
    seconds = round(time.perf_counter() - started, 1)  # the whole trace, the subprocess's start included
    kernels = text.count('custom_call_target="tpu_custom_call"')
    idle = sum(tpu_shard_bytes(shape, size, recipe.sharding.strategy, n) for shape, size in traced.get("idle", []))
    peak = traced.get("host_peak_rss_bytes", 0)
    return TracedStep(request, seconds, peak, digest.hexdigest(), kernels, resident, idle)


def compile_traced(traced: TracedStep, device: Device, work: Path, timeout: float = 3600) -> TpuCompile:
    """Compile a traced step with libtpu for ``device`` and read the figures of one chip."""
    tpu_dir = work / "tpu"
    tpu_dir.mkdir(parents=True, exist_ok=True)
    compiled = _compile(traced.request, work, tpu_dir, timeout)
    base = {
        "device": device.name,
        "topology": device.topology or "",
        "chips": device.devices,
        "capacity": device.hbm_bytes,
        "libtpu": compiled.get("libtpu", "unknown"),
        "kind": compiled.get("kind", ""),
        "trace_seconds": traced.trace_seconds,
        "compile_seconds": compiled.get("compile_seconds", 0.0),
        "host_peak_rss_bytes": max(compiled.get("host_peak_rss_bytes", 0), traced.host_peak_rss_bytes),
        "placeholders": traced.request["placeholders"],
        "donated": compiled.get("donors", 0),
        "resident": traced.resident,
        "idle": traced.idle,
    }
    if "error" in compiled:
        refused = out_of_memory(compiled["error"])
        return TpuCompile(**base, refused=refused, error=None if refused else compiled["error"])
    stats = compiled["stats"]
    hbm = hbm_allocations(buffer_assignment(tpu_dir))
    return TpuCompile(
        **base,
        arguments=stats["argument_size_in_bytes"],
        outputs=stats["output_size_in_bytes"],
        aliased=stats["alias_size_in_bytes"],
        temporaries=hbm.temporaries,
        scratch=hbm.scratch,
        host=hbm.host,
        kernels=traced.kernels,
        generated_code=stats["generated_code_size_in_bytes"],
        cost=compiled.get("cost", {}),
        compiler_stats=stats,
        **program_cost(work / "tpu.hlo.txt", device.devices),
    )


def program_cost(program: Path, chips: int) -> dict[str, Any]:
    """The optimized program's cost with trip counts (``step``: measure.hlo_cost's sums and ``received``, the
    bytes one chip receives by kind of collective) and the bytes its all-gathers produce (``gathered``);
    empty when the compiler wrote no program."""
    from dataclasses import asdict

    from lowmem_tpu.measure.collectives import collectives, gathered_by_dtype, received_by_kind
    from lowmem_tpu.measure.hlo_cost import step_cost

    if not program.exists():
        return {}
    text = program.read_text()
    found = collectives(text, chips)
    step = asdict(step_cost(text)) | {"received": received_by_kind(found)}
    return {"step": step, "gathered": gathered_by_dtype(found)}


def compile_recipe(recipe: Recipe, device: Device, timeout: float = 3600, keep: Path | None = None) -> TpuCompile:
    """Trace the recipe's steady step on ``device.devices`` CPU devices and compile it for ``device``."""
    require_compiler()
    with tempfile.TemporaryDirectory(prefix="lowmem-tpu-compile-") as tmp:
        work = keep or Path(tmp)
        return compile_traced(trace_step(recipe, device, work, timeout), device, work, timeout)


def compiler_fingerprint() -> bytes:
    """The compile step as code: ``libtpu.py``'s syntax tree without its docstrings, so editing its
    prose or layout recompiles no recorded program, and any change to what it does recompiles all of them."""
    import ast

    tree = ast.parse(Path(tpu_compiler_source()).read_text())
    documented = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.walk(tree):
        first = node.body[0] if isinstance(node, documented) and node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def tpu_compiler_source() -> str:
    """The file of :mod:`lowmem_tpu.measure.libtpu`, the TPU compiler's subprocess (beside this module)."""
    return str(Path(__file__).with_name("libtpu.py"))


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def compiler_env(dump: Path) -> dict[str, str]:
    """The environment of libtpu's compile: the user's XLA flags (not those a CPU run adds for XLA:CPU) with the
    dump into ``dump``, the libtpu flags a run on a TPU has, jax's default backend the CPU (never the chips)."""
    from lowmem_tpu.measure.local import with_user_flags
    from lowmem_tpu.xla.runtime import with_libtpu_flags, without_cpu_flags

    flags = without_cpu_flags(with_user_flags(f"--xla_dump_to={dump}"))
    env = os.environ | {"XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"}
    return env | {"LIBTPU_INIT_ARGS": with_libtpu_flags(os.environ.get("LIBTPU_INIT_ARGS", ""))}


def _compile(request: dict[str, Any], work: Path, dump: Path, timeout: float) -> dict[str, Any]:
    """:mod:`lowmem_tpu.measure.libtpu` in a subprocess, stopped before it exhausts the host's RAM."""
    (work / "request.json").write_text(json.dumps(request))
    command = [sys.executable, "-m", "lowmem_tpu.measure.libtpu", str(work / "request.json"), str(work / "tpu.json")]
    with open(work / "tpu.log", "w") as log:
        child = subprocess.Popen(command, env=compiler_env(dump), stdout=log, stderr=subprocess.STDOUT, text=True)
        peak, stopped = _watch(child, timeout)
    result = work / "tpu.json"
    if stopped:
        raise HostMemoryExhausted(
            f"the TPU compiler needed more host RAM than this machine has (stopped at {size(peak)} with less "
            f"than {size(LOW_MEMORY)} of {size(host_memory())} left): compile on a machine with more memory"
        )
    if not result.exists():
        tail = "\n".join((work / "tpu.log").read_text().splitlines()[-20:])
        raise UserError(f"the TPU compiler failed (exit {child.returncode}):\n{tail}")
    return json.loads(result.read_text()) | {"host_peak_rss_bytes": peak}


class HostMemoryExhausted(UserError):
    """This machine's RAM ran out under the TPU compiler: not a verdict on the program."""


LOW_MEMORY = 1 * 2**30  # stop the compiler when the host has less than this left (before the OOM killer)


class CompileTooLong(UserError):
    """The TPU compiler ran past its time here: not a verdict on the program."""


def _watch(child: subprocess.Popen, timeout: float) -> tuple[int, bool]:
    """Wait for ``child``: its peak RSS (sampled), and whether it was stopped for the host's RAM running out.

    At ``timeout`` it is stopped (CompileTooLong); whatever ends the wait (an error, Ctrl-C, SIGTERM made
    SystemExit by :func:`cleanup_on_sigterm`), the compiler is not left running.
    """
    started, peak = time.monotonic(), 0
    try:
        while child.poll() is None:
            peak = max(peak, _rss(child.pid))
            if time.monotonic() - started > timeout:
                raise CompileTooLong(f"the TPU compiler took over {timeout:.0f} s")
            if (meminfo("MemAvailable") or 2**62) < LOW_MEMORY:
                return peak, True
            time.sleep(0.5)
        return peak, False
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def cleanup_on_sigterm() -> None:
    """Make SIGTERM a SystemExit, so temporary directories and the compiler child are removed as on Ctrl-C."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def buffer_assignment(dump: Path) -> Path:
    found = sorted(dump.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not found:
        raise UserError("the TPU compiler wrote no buffer assignment (XLA_FLAGS --xla_dump_to was not honoured)")
    return found[-1]
