"""Measured memory of the real training step on the devices here (XLA:CPU's, or a TPU's), per device.

:func:`compile_step` *compiles* the step without running it: a subprocess
(:mod:`lowmem_tpu.measure.child`; one per device count, since ``CPU_NUM_DEVICES`` and
``XLA_FLAGS`` are read when torch_xla starts) builds the recipe's real training step (model,
LoRA, ``sharding.place_parameters``, ``sharding.wrap_model``, ``trainer.XlaSFTTrainer``), lets
the trainer trace one step and hands it to XLA. The compiler (the CPU's, or the TPU's on a TPU)
writes its buffer assignment for one device's partition; the process exits before the step
executes, so models far too large for this machine can still be measured. A step the TPU
compiler refuses (RESOURCE_EXHAUSTED) comes back as :class:`OutOfMemory`, not as a crash.
Persistent state (weights, gradients, optimizer) is read from the sharded tensors themselves.

:func:`run_steps` runs N real steps on a TPU and reads HBM per device from libtpu's runtime
metrics (``xm.get_memory_info`` refuses the SPMD virtual device: see ``xla/tpu.py``). :func:`spawn_step`
starts the child for both, and for ``tpu_compile``'s trace.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, with_overrides
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.buffers import CompilerFigures, OutOfMemory, dump_flags, largest_program

# ----------------------------------------------------------------------------- shard sizes


def numel_per_device(shape: tuple[int, ...], spec: str) -> int:
    """Elements one device holds of a tensor of ``shape`` with XLA sharding ``spec``.

    ``{devices=[4,1]0,1,2,3}`` splits dim 0 four ways; XLA pads uneven shards, hence the ceil.
    An empty spec or ``{replicated}`` means a full copy per device.
    """
    match = re.search(r"devices=\[([\d,]+)\]", spec)
    tiles = [int(t) for t in match.group(1).split(",")] if match else []
    if "last_tile_dim_replicate" in spec or "last_tile_dims" in spec:
        tiles = tiles[: len(shape)]
    if len(tiles) != len(shape):
        tiles = [1] * len(shape)
    return math.prod(math.ceil(d / t) for d, t in zip(shape, tiles, strict=True))


def device_bytes(tensors: list[Any]) -> int:
    """Bytes one device holds of these XLA tensors, read from their shardings."""
    from lowmem_tpu.xla.device import sharding_spec

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen or t.device.type != "xla":
            continue
        seen.add(id(t))
        total += numel_per_device(tuple(t.shape), sharding_spec(t)) * t.element_size()
    return total


@dataclass(frozen=True)
class PersistentState:
    """Per-device bytes of what outlives a step, read from the sharded tensors."""

    weights: int
    gradients: int  # one per trainable parameter, its shape, dtype and sharding
    optimizer: int
    trainable_parameters: int
    total_parameters: int


def persistent_state(model: Any, optimizer: Any) -> PersistentState:
    """Weights and optimizer state as the devices hold them; gradients as the trainable weights."""
    from lowmem_tpu.model.quantize import logical_parameters

    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    states = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "device")]
    return PersistentState(
        weights=device_bytes(params),
        gradients=device_bytes(trainable),
        optimizer=device_bytes(states),
        trainable_parameters=sum(p.numel() for p in trainable),
        total_parameters=logical_parameters(model),  # a packed int4 byte holds two weights
    )


@dataclass(frozen=True)
class StepMeasurement:
    """The compiler's figures for one device's partition of the real step, and the state it holds.

    ``compiler`` is None when the compiler refused the step (``out_of_memory`` says what it asked for)
    or wrote no buffer assignment (``missing`` says so).
    """

    devices: int
    step: int  # 1: the first step (optimizer state created in it); 2: a steady-state step
    compiler: CompilerFigures | None
    state: PersistentState
    compile_seconds: float | None
    host_peak_rss_bytes: int
    micro_batch_size: int
    platform: str = "CPU"
    out_of_memory: OutOfMemory | None = None
    missing: str | None = None


USER_ERROR = "user_error.txt"  # beside the child's result: a UserError's message, for the parent to say


def spawn_step(
    kind: str, recipe: Recipe, overrides: list[str], steps: int, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Run :mod:`lowmem_tpu.measure.child` in a fresh Python (torch_xla reads its device settings once, at start-up)."""
    with_overrides(recipe, overrides)  # a recipe that cannot run this way fails here, not in the child
    with tempfile.TemporaryDirectory(prefix="lowmem-measure-") as tmp:
        work = Path(tmp)
        (work / "recipe.yaml").write_text(recipe.to_yaml())
        command = [sys.executable, "-m", "lowmem_tpu.measure.child", kind, str(work / "recipe.yaml"), str(steps)]
        command += [str(work / "result.json"), *overrides, f"output_dir={work / 'out'}"]  # the Trainer writes there
        env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"} | env
        what = "compiling the step" if kind == "compile" else f"running {steps} steps"
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"{what} took over {timeout:.0f} s") from None
        said = work / USER_ERROR
        if said.exists():  # the recipe or this install, refused in the child: its message, not a traceback
            raise UserError(said.read_text())
        if not (work / "result.json").exists():
            tail = "\n".join(line for line in done.stderr.splitlines() if "GSPMD" not in line)[-3000:]
            raise UserError(f"{what} failed (exit {done.returncode}):\n{tail}")
        return json.loads((work / "result.json").read_text())


def compile_step(
    recipe: Recipe,
    devices: int,
    *,
    steady: bool = False,
    platform: str = "CPU",
    timeout: float = 3600,
    keep_dump: Path | None = None,
) -> StepMeasurement:
    """Compile the recipe's real training step (in a subprocess) and read its memory per device.

    On the CPU backend: on ``devices`` virtual devices, with the memory-minimizing scheduler. On a
    TPU (``platform="TPU"``): the TPU compiler, on every chip there (``devices`` is not used).
    ``steady`` runs one real step first, so that the measured step holds the optimizer state
    as its inputs, as every later step does (only for models small enough to run here).
    """
    # No persistent cache: a program read from it is not compiled, so no buffer assignment is written.
    overrides = ["runtime.compile_cache_dir=null"]
    if platform == "CPU":
        overrides += ["runtime.device=cpu", f"runtime.num_cpu_devices={devices}"]
    else:
        overrides += ["runtime.device=tpu"]
    with tempfile.TemporaryDirectory(prefix="lowmem-dump-") as tmp:
        dump = keep_dump or Path(tmp)
        dump.mkdir(parents=True, exist_ok=True)
        env = {"PJRT_DEVICE": platform, "XLA_FLAGS": with_user_flags(dump_flags(dump, platform))}
        env["LOWMEM_DUMP_DIR"] = str(dump)
        if platform == "CPU":
            env["CPU_NUM_DEVICES"] = str(devices)
        record = spawn_step("compile", recipe, overrides, 2 if steady else 1, env, timeout)
        oom = OutOfMemory(**record["out_of_memory"]) if record.get("out_of_memory") else None
        figures, missing = None, None
        if oom is None:
            programs = [dump / name for name in record["programs"]] or sorted(dump.glob("*buffer-assignment.txt"))
            try:
                figures = largest_program(programs)
            except UserError as err:
                missing = str(err)
    return StepMeasurement(
        devices=record["num_devices"],
        step=record["step"],
        compiler=figures,
        state=PersistentState(**record["state"]),
        compile_seconds=record.get("compile_seconds"),
        host_peak_rss_bytes=record.get("host_peak_rss_bytes", 0),
        micro_batch_size=record["micro_batch_size"],
        platform=platform,
        out_of_memory=oom,
        missing=missing,
    )


@dataclass(frozen=True)
class TpuRun:
    """What N real steps on a TPU left: HBM per device (libtpu's runtime metrics) and the state held.

    ``peak_bytes`` is the highest sampled HBM in use on any device, None when libtpu's metrics
    could not be read (``memory_error`` says why) or the step did not fit (``out_of_memory``).
    """

    devices: int
    device_kind: str
    steps: int
    peak_bytes: int | None
    limit_bytes: int | None
    per_device: list[dict[str, int]]
    memory_error: str | None
    state: PersistentState
    compile_seconds: float | None
    tokens_per_second: float | None
    micro_batch_size: int
    out_of_memory: OutOfMemory | None = None


def run_steps(recipe: Recipe, steps: int, timeout: float = 7200) -> TpuRun:
    """Run ``steps`` real training steps on the TPU (in a subprocess) and read HBM per device."""
    record = spawn_step("run", recipe, ["runtime.device=tpu"], steps, {"PJRT_DEVICE": "TPU"}, timeout)
    devices = record.get("memory_per_device") or []
    return TpuRun(
        devices=record["num_devices"],
        device_kind=record["device_kind"],
        steps=steps,
        peak_bytes=max(d["peak"] for d in devices) if devices else None,
        limit_bytes=min(d["limit"] for d in devices) if devices else None,
        per_device=devices,
        memory_error=record.get("memory_error"),
        state=PersistentState(**record["state"]),
        compile_seconds=record.get("compile_seconds"),
        tokens_per_second=record.get("tokens_per_second"),
        micro_batch_size=record["micro_batch_size"],
        out_of_memory=OutOfMemory(**record["out_of_memory"]) if record.get("out_of_memory") else None,
    )


def with_user_flags(flags: str) -> str:
    """``flags`` after the user's own XLA_FLAGS (added to, never replaced; a later flag wins in XLA)."""
    return f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
