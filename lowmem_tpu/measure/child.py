"""The subprocess of :mod:`lowmem_tpu.measure.local`: the recipe's real training step, built sharded.

``compile`` traces the step, hands it to XLA and exits before it executes (the compiler writes
its buffer assignment for one device's partition); ``trace`` traces the steady step with no weights
behind it (:mod:`lowmem_tpu.measure.trace`) and leaves the program for the TPU compiler; ``run``
runs N real steps and reads what the devices report. Either way a program the TPU compiler refuses
(RESOURCE_EXHAUSTED) is a result: its figures are recorded, the process exits cleanly.

    python -m lowmem_tpu.measure.child {compile|trace|run} RECIPE.yaml STEPS RESULT.json [OVERRIDES...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, load_recipe, with_fields
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.buffers import out_of_memory
from lowmem_tpu.measure.local import USER_ERROR, persistent_state


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

    from lowmem_tpu.model import apply_lora, load_config, meta_model
    from lowmem_tpu.model.build import require_config
    from lowmem_tpu.xla.sharding import place_parameters

    config = load_config(recipe.model, offline=True) or require_config(recipe)
    model = apply_lora(meta_model(config, recipe.model), recipe, weightless=True)
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
    """Rows of ``data.max_length`` random tokens: the step's shapes are the real data's (every row is
    padded; packed rows carry segment ids and positions too)."""
    import datasets
    import numpy as np

    length = recipe.data.max_length
    ids = np.random.default_rng(0).integers(3, vocab_size, size=(rows, length)).tolist()
    columns = {"input_ids": ids, "attention_mask": [[1] * length] * rows, "labels": ids}
    if recipe.data.packing:  # four samples per row, as data.rows packs them
        quarter = -(-length // 4)
        columns["position_ids"] = [[i % quarter for i in range(length)]] * rows
        columns["segment_ids"] = [[1 + i // quarter for i in range(length)]] * rows
    return datasets.Dataset.from_dict(columns)


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
    """The trainer a run of the recipe's method builds, on synthetic rows of the recipe's shape: the program
    measured is the one a run executes."""
    from lowmem_tpu.train.methods import build_method_trainer

    rows = recipe.train.global_batch_size * (recipe.train.max_steps + 1)
    vocab = model.config.get_text_config().vocab_size
    method = METHODS[recipe.method]
    make = synthetic_pairs if method.pairs else synthetic_unpaired if method.preference else synthetic_dataset
    dataset = make(recipe, vocab, rows)
    return build_method_trainer(recipe, runtime, model, dataset, any_tokenizer(recipe), micro, [callback])


def synthetic_pairs(recipe: Recipe, vocab_size: int, pairs: int) -> Any:
    """Preference rows of ``data.max_length`` random tokens, chosen and rejected each, half of them completion."""
    import datasets
    import numpy as np

    length = recipe.data.max_length
    ids = np.random.default_rng(0).integers(3, vocab_size, size=(pairs, 2, length))
    completion = np.zeros((pairs, 2, length), dtype=np.int64)
    completion[:, :, length // 2 :] = 1
    columns = {"input_ids": ids, "attention_mask": np.ones_like(ids), "completion_mask": completion}
    return datasets.Dataset.from_dict({key: value.tolist() for key, value in columns.items()})


def synthetic_unpaired(recipe: Recipe, vocab_size: int, rows: int) -> Any:
    """KTO's labelled rows of ``data.max_length`` random tokens, half of them completion, half desirable."""
    import datasets
    import numpy as np

    length = recipe.data.max_length
    ids = np.random.default_rng(0).integers(3, vocab_size, size=(rows, length))
    completion = np.zeros((rows, length), dtype=np.int64)
    completion[:, length // 2 :] = 1
    columns = {"input_ids": ids, "attention_mask": np.ones_like(ids), "completion_mask": completion}
    columns["label"] = np.arange(rows) % 2 == 0
    return datasets.Dataset.from_dict({key: value.tolist() for key, value in columns.items()})


def _finish(record: dict[str, Any], result: Path) -> None:
    result.write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # leave before anything else executes: it may need more memory than this host has


def _refused(err: Exception, record: dict[str, Any], result: Path, model: Any, optimizer: Any) -> None:
    """A RESOURCE_EXHAUSTED from the compiler is this measurement's result; anything else is re-raised."""
    oom = out_of_memory(str(err))
    if oom is None:
        raise err
    record["out_of_memory"] = asdict(oom)
    record["state"] = asdict(persistent_state(model, optimizer))
    _finish(record, result)


def _hook(kind: str, steps: int, record: dict[str, Any], result: Path) -> Any:
    """The trainer callback of :func:`_child`: times ``run``; compiles, records and exits for ``compile``."""
    from transformers import TrainerCallback

    from lowmem_tpu.xla import runtime as rt

    dump = Path(os.environ.get("LOWMEM_DUMP_DIR", "."))

    class Hook(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            if kind == "compile" and state.global_step in (0, steps - 1):
                # With accumulation each micro-batch is compiled (and cut) inside the step: count them.
                # A step that compiles nothing runs step 1's programs (train.steady): those, then.
                key = "_first" if state.global_step == 0 and steps > 1 else "_before"
                record[key] = sorted(p.name for p in dump.glob("*buffer-assignment.txt"))
            if kind == "run" and state.global_step == min(2, steps - 1):
                rt.sync()
                rt.wait()  # warm-up (and its compilations) done: time the steps after it
                record["timed_from"] = (state.global_step, time.perf_counter())

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
            if kind != "compile" or state.global_step < steps:
                return
            optimizer = getattr(optimizer, "optimizer", optimizer)
            before, first = set(record.pop("_before", [])), set(record.pop("_first", []))
            started = time.perf_counter()
            try:
                rt.sync()  # compiles the step now; its execution is queued and never waited for
            except (RuntimeError, ValueError) as err:
                _refused(err, record, result, model, optimizer)
            record["compile_seconds"] = round(time.perf_counter() - started, 2)
            record["state"] = asdict(persistent_state(model, optimizer))
            compiled = sorted(p.name for p in dump.glob("*buffer-assignment.txt"))
            record["programs"] = [n for n in compiled if n not in before] or [n for n in compiled if n not in first]
            record["host_peak_rss_bytes"] = _host_peak_rss()
            _finish(record, result)

    return Hook()


def _trace_hook(record: dict[str, Any], result: Path) -> Any:
    """The trainer callback of a ``trace``: optimizer state made before step 1, the step's program kept."""
    from transformers import TrainerCallback

    from lowmem_tpu.measure.trace import ProgramWatcher, prefill_optimizer_state, resident_tensors
    from lowmem_tpu.xla import runtime as rt

    dump = Path(os.environ["LOWMEM_DUMP_DIR"])

    def done(module: Path, text: Path) -> None:
        idle = record.pop("_idle")()
        record["placeholders"] -= len(idle)  # weights the step never reads are no argument of its program
        record["model_placeholders"] -= len(idle)
        record["idle"] = resident_tensors(idle)
        record.update(module=str(module), module_text=str(text), host_peak_rss_bytes=_host_peak_rss())
        record["trace_seconds"] = round(time.perf_counter() - record.pop("_started"), 2)
        _finish(record, result)

    class Hook(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs) -> None:
            state = prefill_optimizer_state(getattr(optimizer, "optimizer", optimizer))
            record["placeholders"] += len(state)
            record["resident"] += resident_tensors(state)

        def on_step_begin(self, args, state, control, **kwargs) -> None:
            # The next program handed over is the step's: its first micro-batch's with accumulation (the
            # trainer cuts the graph after each backward), else the whole step at on_step_end's sync.
            record["_started"] = time.perf_counter()
            ProgramWatcher(dump, done).start()

        def on_step_end(self, args, state, control, **kwargs) -> None:
            rt.sync()  # hands the step to the CPU compiler: the watcher refuses its execution, takes it, leaves
            time.sleep(600)  # never reached unless the dump is missing

    return Hook()


def _idle_weights(model: Any) -> Any:
    """A function giving the weights of every module the step did not run (a multimodal checkpoint's vision
    tower when training on text): they sit in HBM, sharded like the rest, but are no argument of the step.
    The LM head counts as run: the chunked loss reads its weight without calling it; so do the LoRA weights
    of a stacked expert that ran (PEFT reads them without calling their modules)."""
    ran: set[int] = set()
    holders = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    folding = [m for m in model.modules() if hasattr(m, "parameter_name") and hasattr(m, "lora_A")]
    for module in (*holders, *folding):
        module.register_forward_hook(lambda m, args, out: ran.add(id(m)))
    head = model.get_output_embeddings()

    def idle() -> list[Any]:
        used = {id(p) for m in holders if id(m) in ran for p in m.parameters(recurse=False)}
        used |= {id(p) for m in folding if id(m) in ran for p in m.parameters()}
        used |= {id(p) for p in (head.parameters() if head is not None else [])}
        return list({id(p): p for p in model.parameters() if id(p) not in used}.values())

    return idle


def _trace(recipe: Recipe, runtime: Any, micro: int, record: dict[str, Any], result: Path) -> None:
    import torch

    from lowmem_tpu.config.features import experts_of
    from lowmem_tpu.measure.trace import placeholder_model, resident_tensors
    from lowmem_tpu.model.build import require_config
    from lowmem_tpu.xla import experts, flash
    from lowmem_tpu.xla.pallas import lower_pallas_for_tpu
    from lowmem_tpu.xla.sharding import placeholder, placeholders_unmarked

    moe = experts_of(require_config(recipe)) is not None
    if recipe.model.attn_implementation == "flash" or moe:
        lower_pallas_for_tpu()  # the kernels are TPU code in a trace that never runs
    if recipe.model.attn_implementation == "flash":
        flash.install()
    if moe:
        experts.install(runtime.num_devices)
    model, record["placeholders"] = placeholder_model(recipe, runtime)
    record["_idle"] = _idle_weights(model)
    # With accumulation the program traced is the first micro-batch's forward and backward: it takes
    # the model's placeholders only, while the optimizer state and master weights (``resident``) wait
    # in HBM for the optimizer's program after the last micro-batch.
    record["model_placeholders"], record["resident"] = record["placeholders"], []
    trainer = _trainer(recipe, runtime, model, micro, _trace_hook(record, result))
    if METHODS[recipe.method].preference:
        from lowmem_tpu.xla.sharding import fresh_placeholders

        fresh_placeholders(model)

    def fp32_copy(param: Any) -> Any:  # the master weights, as placeholders too
        record["placeholders"] += 1
        copy = placeholder(param.shape, torch.float32)
        record["resident"] += resident_tensors([copy])
        return copy

    trainer._fp32_copy = fp32_copy
    trainer.placeholder_weights = True
    with placeholders_unmarked():
        try:
            trainer.train()
        except RuntimeError:
            # The program's execution refused (at on_step_end's sync, or with accumulation at the sync after
            # the first micro-batch's backward, inside the trainer's step), or TPU-only code (a Pallas kernel)
            # the CPU compiler refused after the dump was written: the watcher takes the program and leaves,
            # unless the refusal came before the dump.
            time.sleep(30)
            raise
    raise RuntimeError("the step's program was not handed to the compiler")


def _child(kind: str, recipe_path: str, steps: int, result: Path, overrides: list[str]) -> None:
    """The subprocess: ``compile`` traces the real step and compiles it, ``run`` runs ``steps`` real steps.

    ``compile`` exits as soon as the step is compiled, before it executes (with ``steps=2`` the
    first step runs for real, so that the compiled one holds the optimizer state as inputs).
    """
    from lowmem_tpu.config import micro_batch_size
    from lowmem_tpu.xla import runtime as rt

    recipe = load_recipe(recipe_path, [*overrides, f"train.max_steps={steps}", "train.eval_steps=null"])
    devices = recipe.runtime
    if kind == "trace":  # the recipe stays the TPU run it stands for; its step is traced on CPU devices instead
        devices = with_fields(devices, device="cpu", num_cpu_devices=int(os.environ["LOWMEM_TRACE_CPU_DEVICES"]))
    runtime = rt.setup_runtime(devices)
    micro = micro_batch_size(recipe, runtime.num_devices)
    record: dict[str, Any] = {"num_devices": runtime.num_devices, "micro_batch_size": micro, "step": steps}
    record["device_kind"] = runtime.kind
    if kind == "trace":
        _trace(recipe, runtime, micro, record, result)
    model = build_sharded_model(recipe, runtime)
    trainer = _trainer(recipe, runtime, model, micro, _hook(kind, steps, record, result))
    try:
        trainer.train()
        rt.wait()
    except (RuntimeError, ValueError) as err:  # a step the compiler refused, before the hook's
        _refused(err, record, result, model, trainer.optimizer)
    first, started = record.pop("timed_from", (0, time.perf_counter()))
    seconds = time.perf_counter() - started
    tokens = (steps - first) * recipe.train.global_batch_size * recipe.data.max_length
    record |= {
        "state": asdict(persistent_state(model, trainer.optimizer)),
        "memory_per_device": runtime.memory_per_device(),
        "memory_error": runtime.monitor.error if runtime.monitor else "the CPU backend keeps no allocator statistics",
        "compile_seconds": round(rt.compile_seconds(), 2),
        "tokens_per_second": tokens / seconds if seconds > 0 and steps > first else None,
    }
    result.write_text(json.dumps(record))


if __name__ == "__main__":  # the subprocess of local.compile_step, local.run_steps and tpu_compile.trace_step
    try:
        _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:])
    except UserError as err:  # the parent says it as its own (local.spawn_step): no child's traceback
        Path(sys.argv[4]).with_name(USER_ERROR).write_text(str(err))
        sys.exit(2)
