"""Measured memory of the real training step, per device.

On the CPU backend the step is *compiled*, not run: a subprocess (one per device count,
since ``CPU_NUM_DEVICES`` and ``XLA_FLAGS`` are read when torch_xla starts) builds the
recipe's real training step (model, LoRA, ``sharding.place_parameters``,
``sharding.wrap_model``, ``trainer.XlaSFTTrainer``), lets the trainer trace one step and
hands it to XLA. The compiler writes its buffer assignment for one device's partition;
the process exits before the step executes, so models far too large for this machine
can still be measured. Persistent state (weights, gradients, optimizer) is read from
the sharded tensors themselves.

On a TPU, N real steps run and the runtime's peak (``xm.get_memory_info``) is read.
torch_xla is imported only inside functions (through ``runtime``) and in the subprocess.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, load_recipe
from lowmem_tpu.errors import UserError
from lowmem_tpu.memory.compiler import DUMP_FLAGS, CompilerFigures, largest_program

# ----------------------------------------------------------------------------- shard sizes


def shard_numel(shape: tuple[int, ...], spec: str) -> int:
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
        total += shard_numel(tuple(t.shape), sharding_spec(t)) * t.element_size()
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


# ----------------------------------------------------------------------------- the real step, built sharded


def build_sharded_model(recipe: Recipe, runtime: Any) -> Any:
    """The recipe's model (quantized and LoRA applied) with random weights, one module at a time.

    The model is built on the ``meta`` device, its linears swapped for ``QuantizedLinear``s when
    ``model.quantize`` asks (before LoRA, as ``lowmem-tpu sft`` does); each module's own parameters
    are then created on the host (random integers for a quantized weight) and moved by
    ``sharding.place_parameters``, which shards each on arrival. The host never holds more than
    one module, so a 3B model fits where a full host copy would not. The device ends up holding
    exactly what ``lowmem-tpu sft`` places (same shapes, dtypes, shardings); only the values
    differ, which memory does not depend on.
    """
    import torch

    from lowmem_tpu.memory.shape import require_config
    from lowmem_tpu.model import apply_lora, load_config, meta_model
    from lowmem_tpu.xla.sharding import place_parameters

    config = load_config(recipe.model, offline=True) or require_config(recipe)
    model = apply_lora(meta_model(config, recipe.model), recipe)
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            continue
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    param.normal_(0.0, 0.02)
                elif param.dtype == torch.uint8:  # packed int4: two nibbles in 1..15
                    param.random_(0, 256)
                else:  # int8 weights in the quantizer's range
                    param.random_(-127, 128)
        place_parameters(module, runtime, recipe.sharding.strategy)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def synthetic_dataset(recipe: Recipe, vocab_size: int, rows: int) -> Any:
    """Rows of ``data.max_length`` random tokens: the step's shapes are the real data's (every row is padded)."""
    import datasets
    import numpy as np

    ids = np.random.default_rng(0).integers(3, vocab_size, size=(rows, recipe.data.max_length)).tolist()
    ones = [[1] * recipe.data.max_length] * rows
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": ones, "labels": ids})


def any_tokenizer(recipe: Recipe) -> Any:
    """The recipe's tokenizer when it is available offline, else the shipped one (only its pad id is used)."""
    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import load_tokenizer

    try:
        return load_tokenizer(recipe.model)
    except (UserError, OSError, ValueError):
        return load_tokenizer(ModelSection(name_or_path="builtin:tiny-llama", random_init=True))


def _host_peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _trainer(recipe: Recipe, runtime: Any, model: Any, micro: int, callback: Any) -> Any:
    """The XlaSFTTrainer ``lowmem-tpu sft`` builds, on synthetic rows of the recipe's shape."""
    from lowmem_tpu.train.trainer import build_trainer

    rows = recipe.train.global_batch_size * (recipe.train.max_steps + 1)
    dataset = synthetic_dataset(recipe, model.config.vocab_size, rows)
    return build_trainer(recipe, runtime, model, dataset, any_tokenizer(recipe), micro, [callback])


def _hook(kind: str, steps: int, record: dict[str, Any], result: Path) -> Any:
    """The trainer callback of :func:`_child`: times ``run``; compiles, records and exits for ``compile``."""
    from transformers import TrainerCallback

    from lowmem_tpu.xla import runtime as rt

    dump = Path(os.environ.get("LOWMEM_DUMP_DIR", "."))

    class Hook(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            if kind == "run" and state.global_step == min(2, steps - 1):
                rt.sync()
                rt.wait()  # warm-up (and its compilations) done: time the steps after it
                record["timed_from"] = (state.global_step, time.perf_counter())

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
            if kind != "compile" or state.global_step < steps:
                return
            before = {p.name for p in dump.glob("*buffer-assignment.txt")}
            started = time.perf_counter()
            rt.sync()  # compiles the step now; its execution is queued and never waited for
            record["compile_seconds"] = round(time.perf_counter() - started, 2)
            record["state"] = asdict(persistent_state(model, getattr(optimizer, "optimizer", optimizer)))
            record["programs"] = sorted(p.name for p in dump.glob("*buffer-assignment.txt") if p.name not in before)
            record["host_peak_rss_bytes"] = _host_peak_rss()
            result.write_text(json.dumps(record))
            sys.stdout.flush()
            os._exit(0)  # leave before the step executes: it may need more memory than this host has

    return Hook()


def _child(kind: str, recipe_path: str, steps: int, result: Path, overrides: list[str]) -> None:
    """The subprocess: ``compile`` traces the real step and compiles it, ``run`` runs ``steps`` real steps.

    ``compile`` exits as soon as the step is compiled, before it executes (with ``steps=2`` the
    first step runs for real, so that the compiled one holds the optimizer state as inputs).
    """
    from lowmem_tpu.config import micro_batch_size
    from lowmem_tpu.xla import runtime as rt

    recipe = load_recipe(recipe_path, [*overrides, f"train.max_steps={steps}", "train.eval_steps=null"])
    runtime = rt.setup_runtime(recipe.runtime)
    micro = micro_batch_size(recipe, runtime.num_devices)
    model = build_sharded_model(recipe, runtime)
    record: dict[str, Any] = {"num_devices": runtime.num_devices, "micro_batch_size": micro, "step": steps}
    trainer = _trainer(recipe, runtime, model, micro, _hook(kind, steps, record, result))
    trainer.train()
    rt.wait()
    first, started = record.pop("timed_from", (0, time.perf_counter()))
    seconds = time.perf_counter() - started
    tokens = (steps - first) * recipe.train.global_batch_size * recipe.data.max_length
    record |= {
        "state": asdict(persistent_state(model, trainer.optimizer)),
        "memory": rt.memory_info(),
        "compile_seconds": round(rt.compile_seconds(), 2),
        "tokens_per_second": tokens / seconds if seconds > 0 and steps > first else None,
        "device_kind": runtime.kind,
    }
    result.write_text(json.dumps(record))


@dataclass(frozen=True)
class StepMeasurement:
    """The CPU compiler's figures for one device's partition of the real step, and the state it holds."""

    devices: int
    step: int  # 1: the first step (optimizer state created in it); 2: a steady-state step
    compiler: CompilerFigures
    state: PersistentState
    compile_seconds: float
    host_peak_rss_bytes: int
    micro_batch_size: int


def _spawn(kind: str, recipe: Recipe, overrides: list[str], steps: int, env: dict[str, str], timeout: float) -> dict:
    """Run :func:`_child` in a fresh Python (torch_xla reads its device settings once, at start-up)."""
    load_recipe_text(recipe, overrides)  # a recipe that cannot run this way fails here, not in the child
    with tempfile.TemporaryDirectory(prefix="lowmem-measure-") as tmp:
        work = Path(tmp)
        (work / "recipe.yaml").write_text(recipe.to_yaml())
        command = [sys.executable, "-m", "lowmem_tpu.memory.measure", kind, str(work / "recipe.yaml"), str(steps)]
        command += [str(work / "result.json"), *overrides, f"output_dir={work / 'out'}"]  # the Trainer writes there
        env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"} | env
        what = "compiling the step" if kind == "compile" else f"running {steps} steps"
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"{what} took over {timeout:.0f} s") from None
        if not (work / "result.json").exists():
            tail = "\n".join(line for line in done.stderr.splitlines() if "GSPMD" not in line)[-3000:]
            raise UserError(f"{what} failed (exit {done.returncode}):\n{tail}")
        return json.loads((work / "result.json").read_text())


def compile_step(
    recipe: Recipe, devices: int, *, steady: bool = False, timeout: float = 3600, keep_dump: Path | None = None
) -> StepMeasurement:
    """Compile the recipe's real training step on ``devices`` CPU devices (in a subprocess) and read its memory.

    ``steady`` runs one real step first, so that the measured step holds the optimizer state
    as its inputs, as every later step does (only for models small enough to run here).
    """
    # No persistent cache: the CPU backend cannot read it back, and the step must compile here.
    overrides = ["runtime.device=cpu", f"runtime.num_cpu_devices={devices}", "runtime.compile_cache_dir=null"]
    with tempfile.TemporaryDirectory(prefix="lowmem-dump-") as tmp:
        dump = keep_dump or Path(tmp)
        dump.mkdir(parents=True, exist_ok=True)
        env = {
            "PJRT_DEVICE": "CPU",
            "CPU_NUM_DEVICES": str(devices),
            "XLA_FLAGS": DUMP_FLAGS.format(dir=dump),
            "LOWMEM_DUMP_DIR": str(dump),
        }
        record = _spawn("compile", recipe, overrides, 2 if steady else 1, env, timeout)
        programs = [dump / name for name in record["programs"]] or sorted(dump.glob("*buffer-assignment.txt"))
        figures = largest_program(programs)
    return StepMeasurement(
        devices=record["num_devices"],
        step=record["step"],
        compiler=figures,
        state=PersistentState(**record["state"]),
        compile_seconds=record["compile_seconds"],
        host_peak_rss_bytes=record["host_peak_rss_bytes"],
        micro_batch_size=record["micro_batch_size"],
    )


@dataclass(frozen=True)
class TpuRun:
    """What N real steps on a TPU left: the runtime's peak and the state the devices hold."""

    devices: int
    device_kind: str
    steps: int
    peak_bytes: int
    limit_bytes: int
    state: PersistentState
    compile_seconds: float
    tokens_per_second: float | None
    micro_batch_size: int


def run_steps(recipe: Recipe, steps: int, timeout: float = 7200) -> TpuRun:
    """Run ``steps`` real training steps on the TPU (in a subprocess) and read its memory peak."""
    record = _spawn("run", recipe, ["runtime.device=tpu"], steps, {"PJRT_DEVICE": "TPU"}, timeout)
    memory = record["memory"]
    return TpuRun(
        devices=record["num_devices"],
        device_kind=record["device_kind"],
        steps=steps,
        peak_bytes=int(memory.get("peak_bytes_used", memory.get("bytes_used", 0))),
        limit_bytes=int(memory.get("bytes_limit", 0)),
        state=PersistentState(**record["state"]),
        compile_seconds=record["compile_seconds"],
        tokens_per_second=record["tokens_per_second"],
        micro_batch_size=record["micro_batch_size"],
    )


def load_recipe_text(recipe: Recipe, overrides: list[str]) -> Recipe:
    """``recipe`` re-validated with ``overrides`` applied (e.g. another device count)."""
    import yaml

    from lowmem_tpu.config import apply_overrides, validate_recipe

    return validate_recipe(apply_overrides(yaml.safe_load(recipe.to_yaml()), overrides))


if __name__ == "__main__":  # the subprocess of compile_step and run_steps
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:])
