"""Training checkpoints that are only ever used once complete: the whole on-disk format, written and read here.

A checkpoint is written to ``output_dir/checkpoints/step-N.partial`` and renamed to
``step-N`` after its ``COMPLETE`` marker (written last); older checkpoints are deleted only
after that. ``state/`` holds the sharded tensors in ``torch.distributed.checkpoint`` form, each
host writing its own shards (``xla.sharded_state``): the trainable weights (``trainable/NAME``,
clean names), the optimizer's state (``optimizer/I/KEY``) and fp32 master weights (``master/J``).
Beside it, written by host 0: the optimizer's param groups, the scheduler, the RNG states (the
Trainer's own ``rng_state.pth``), ``trainer_state.json`` (step and data position), the resolved
recipe, and what ``lowmem-tpu export`` needs to turn the checkpoint into an adapter or a model
(``export/``: the adapter's config and key map, or the model's config; the tokenizer).

A run asks :func:`find_resume` where it continues from and :func:`check_run_room` for room on its disk;
its trainer's overrides call :func:`save`, :func:`load_trainable` and :func:`load_optimizer_and_scheduler`;
``lowmem-tpu export`` reads a checkpoint on the host alone (:func:`read_trainable`).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from lowmem_tpu import faults, hosts
from lowmem_tpu.config.validate import without_removed
from lowmem_tpu.errors import NonFiniteError, UserError
from lowmem_tpu.files import (
    check_room,  # the disk check, before each save too (trainer: ckpt.check_room)
    damage,
    disk_full,
    fresh_partial,
    publish,
    write_json,
    write_manifest,
)
from lowmem_tpu.train.master import MASTERS, checkpoint_state, masters_of, restore_checkpoint_state

COMPLETE = "COMPLETE"
STATE = "state"
GROUPS = "optimizer_groups.pt"
EXPORT = "export"
ADAPTER_KEYS = "adapter_keys.json"
TRAINABLE, OPTIMIZER, MASTER = "trainable/", "optimizer/", "master/"
SAVE_MARGIN = 2**20  # a checkpoint's small files beside its tensors (tokenizer, configs, RNG, metadata)
SCHEDULER = "scheduler.pt"
RECIPE = "recipe.yaml"
TRAINER_STATE = "trainer_state.json"  # transformers' own (TRAINER_STATE_NAME), read by it on resume
STEP_DIR = re.compile(r"^step-(\d+)$")

# Recipe fields that must not change between a checkpoint and the run that resumes it.
FROZEN_FIELDS = ("model", "lora", "data", "train.global_batch_size", "train.gradient_accumulation_steps", "train.seed")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()]
    return [p for _, p in sorted(found)]


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete checkpoints a crash left half-written; returns what was removed."""
    root = checkpoints_dir(output_dir)
    stale = [p for p in root.iterdir() if p.is_dir() and not (p / COMPLETE).exists()] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path)
    return stale


def resolve_resume(setting: str, output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (``auto``: the latest whole one; ``never``; or a path), and warnings.

    Every file is checked against the checkpoint's manifest first. With ``auto`` a damaged checkpoint
    (a truncated copy, a disk that filled) is passed over for the one before it, with a warning naming
    it; a damaged one named by path, or none whole left, is a UserError saying what to do.
    """
    if setting == "never":
        return None, []
    if setting != "auto":
        path = Path(setting).expanduser()
        if not (path / COMPLETE).exists():
            raise UserError(f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker)")
        problem = _problem(path)
        if problem:
            raise UserError(f"train.resume: {path} is damaged ({problem}); name another checkpoint, or auto")
        return path, []
    warnings_, found = [], complete_checkpoints(output_dir)
    for path in reversed(found):
        problem = _problem(path)
        if problem is None:
            return path, warnings_
        warnings_.append(f"warning: {path} is damaged ({problem}); not resuming from it")
    if found:
        raise UserError(
            [
                *(w.removeprefix("warning: ") for w in warnings_),
                f"train.resume: no whole checkpoint is left in {checkpoints_dir(output_dir)}; start over with "
                "train.resume=never (the damaged ones stay where they are)",
            ]
        )
    return None, []


def find_resume(recipe: Any, out: Path, force: bool) -> Path | None:
    """The checkpoint this run continues from, after cleaning up half-written ones (said on the console)."""
    from lowmem_tpu.console import say

    for stale in remove_incomplete(out) if hosts.is_main() else []:
        say(f"removed an incomplete checkpoint: {stale}")
    hosts.barrier()
    resume, notes = resolve_resume(recipe.train.resume, out)
    for note in notes:
        say(note)
    if resume is None:
        return None
    changes = recipe_changes(resume, recipe.model_dump(mode="json"))
    if changes and not force:
        raise UserError(
            [
                f"train.resume: {resume} was trained with a different recipe:",
                *(f"  {c}" for c in changes),
                "resume with the same settings, set train.resume=never (start over), or pass --force-resume",
            ]
        )
    say(f"resuming from {resume}" + (f" despite {len(changes)} changed settings" if changes else ""))
    return resume


def _problem(path: Path) -> str | None:
    if not (path / STATE / ".metadata").is_file() and (path / "trainable.safetensors").is_file():
        return "written by an earlier lowmem-tpu, as one host's safetensors: resume it with that version"
    return damage(path)


def recipe_changes(checkpoint: Path, recipe_data: dict[str, Any]) -> list[str]:
    """Field-by-field differences in the fields a resumed run must keep."""
    saved = without_removed(yaml.safe_load((checkpoint / RECIPE).read_text()))  # a run saved before a key went
    changes = []
    for field in FROZEN_FIELDS:
        before, after = _lookup(saved, field), _lookup(recipe_data, field)
        if isinstance(before, dict) and isinstance(after, dict):
            keys = sorted(set(before) | set(after))
            changes += [
                f"{field}.{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)
            ]
        elif before != after:
            changes.append(f"{field}: {before!r} -> {after!r}")
    return changes


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part, {}) if isinstance(data, dict) else {}
    return data


def optimizer_entries(state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An optimizer's checkpoint state as flat entries (``optimizer/I/KEY``, ``master/J``) and its param groups."""
    flat = {f"{OPTIMIZER}{i}/{k}": v for i, values in state["state"].items() for k, v in values.items()}
    flat |= {f"{MASTER}{j}": m for j, m in enumerate(state.get(MASTERS) or [])}
    return flat, state["param_groups"]


def optimizer_state_of(entries: dict[str, Any]) -> dict[tuple[int, str], Any]:
    """The ``optimizer/I/KEY`` entries by (parameter index, key)."""
    out = {}
    for key, value in entries.items():
        if key.startswith(OPTIMIZER):
            index, name = key.removeprefix(OPTIMIZER).split("/", 1)
            out[int(index), name] = value
    return out


def read_metadata(directory: Path) -> dict[str, Any]:
    """Every entry's storage metadata in a checkpoint's ``state/`` (tensor shapes and dtypes), by key."""
    import torch.distributed.checkpoint as dcp

    return dict(dcp.FileSystemReader(str(directory / STATE)).read_metadata().state_dict_metadata)


def read_whole(directory: Path, prefix: str = "") -> dict[str, Any]:
    """The entries under ``prefix`` as whole host tensors (or saved objects), on any machine, no devices."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    targets: dict[str, Any] = {}
    for key, meta in read_metadata(directory).items():
        if key.startswith(prefix):
            is_tensor = isinstance(meta, TensorStorageMetadata)
            targets[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor else None
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(directory / STATE)), no_dist=True)
    return targets


def read_trainable(directory: Path) -> dict[str, torch.Tensor]:
    """The trainable weights of a checkpoint under their clean names."""
    return {k.removeprefix(TRAINABLE): v for k, v in read_whole(directory, TRAINABLE).items()}


def finish(partial: Path, keep_last: int) -> Path:
    """Record a written checkpoint's files, mark it complete, publish it, then prune the oldest complete ones."""
    write_manifest(partial)
    (partial / COMPLETE).write_text("ok\n")
    faults.point("save-complete")
    final = partial.with_name(partial.name.removesuffix(".partial"))
    publish(partial, final)
    faults.point("save-prune")
    for old in complete_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old)
    return final


def state_bytes(model: Any, optimizer: str, master_weights: bool, lora: bool) -> tuple[int, int]:
    """Bytes of one checkpoint (trainable weights + optimizer state + masters) and of ``final/``'s weights.

    AdamW keeps two fp32 moments per trainable parameter; Adafactor's factored moments are a few
    vectors per matrix (counted as nothing); masters are one fp32 copy.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    weights = sum(p.numel() * p.element_size() for p in trainable)
    extra = count * ((8 if optimizer == "adamw" else 0) + (4 if master_weights else 0))
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + extra, weights if lora else every


def check_run_room(recipe: Any, model: Any, out: Path) -> None:
    """Before training: room on the output disk for the checkpoints that will coexist and for ``final/``."""
    from lowmem_tpu.config.schema import uses_master_weights
    from lowmem_tpu.console import size

    t = recipe.train
    one, final = state_bytes(model, t.optimizer, uses_master_weights(recipe), recipe.lora.enabled)
    saves = max(0, t.keep_last + 1 - len(complete_checkpoints(out))) if t.save_steps else 0
    what = f"this run ({saves} more checkpoint(s) of {size(one)} and final/ of {size(final)})"
    if hosts.is_main():
        check_room(out, saves * (one + SAVE_MARGIN) + final, what)


# Writing and reading a run's checkpoint (the trainer's ``_save_checkpoint`` and resume overrides call these).


def save(trainer: Any) -> Path:
    """Write ``trainer``'s checkpoint at its current step and return it: sharded state in DCP form (every
    host writes its shards), then host 0 writes the rest and publishes it whole (:func:`finish`).

    ``trainer`` is the run's XLA trainer: its parameter names, optimizer, scheduler, state and recipe.
    """
    from lowmem_tpu.xla import sharded_state

    step = trainer.state.global_step
    trainable = {f"{TRAINABLE}{n}": p.detach() for n, p in trainer.names.params.items() if p.requires_grad}
    optimizer, groups = optimizer_entries(checkpoint_state(trainer.optimizer))
    fetched = sharded_state.fetch(trainable | optimizer)
    bad = [k for k in trainable if not all(torch.isfinite(v).all() for v in sharded_state.host_values(fetched[k]))]
    if not hosts.all_true(not bad):
        where = bad[0].removeprefix(TRAINABLE) if bad else "another host's shards"
        raise NonFiniteError(f"step {step}: non-finite values in {where}; no checkpoint written")
    final = checkpoints_dir(trainer.args.output_dir) / f"step-{step}"
    partial = final.with_name(final.name + ".partial")
    need = sum(t.numel() * t.element_size() for v in fetched.values() for t in sharded_state.host_values(v))
    check_room(final.parent, need + SAVE_MARGIN, f"checkpoint step-{step}")
    if hosts.is_main():
        fresh_partial(final)
    hosts.barrier()  # the directory exists before any host writes into it
    try:
        sharded_state.write(fetched, partial / STATE)
    except Exception as err:
        if not disk_full(err):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(
            f"checkpoint step-{step}: the disk of {partial.parent} filled while writing it ({need:,} bytes); "
            "what was written of it is removed and the previous checkpoint is intact: free space there, "
            "choose another output_dir, or lower train.keep_last, then run the same command to resume"
        ) from None
    faults.point("save-state")
    if hosts.is_main():
        torch.save(groups, partial / GROUPS)
        torch.save(trainer.lr_scheduler.state_dict(), partial / SCHEDULER)
        trainer._save_rng_state(str(partial))
        trainer.state.save_to_json(str(partial / TRAINER_STATE))
        (partial / RECIPE).write_text(trainer.recipe.to_yaml())
        save_export_files(trainer, partial / EXPORT)
        faults.point("save-files")
        finish(partial, trainer.recipe.train.keep_last)
    hosts.barrier()  # every host sees the finished checkpoint
    return final


def save_export_files(trainer: Any, directory: Path) -> None:
    """What ``lowmem-tpu export`` needs besides the weights: the adapter's config and key map, or the model's."""
    directory.mkdir()
    model = trainer.model  # unwrapped
    if trainer.names.adapter_keys:
        config = model.peft_config["default"]
        config.base_model_name_or_path = trainer.base_reference or config.base_model_name_or_path
        config.save_pretrained(str(directory))
        write_json(directory / ADAPTER_KEYS, trainer.names.adapter_keys)
        if initial := getattr(model, "initial_adapter", None):  # PiSSA/OLoRA: exported for the original base
            from safetensors.torch import save_file

            from lowmem_tpu.model.lora import INITIAL_ADAPTER

            save_file(initial, str(directory / INITIAL_ADAPTER), metadata={"format": "pt"})
    else:
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
    if trainer.processing_class is not None:
        from lowmem_tpu.model import save_tokenizer

        save_tokenizer(trainer.processing_class, directory)
    (directory / RECIPE).write_text(trainer.recipe.to_yaml())  # how generate formats prompts


def load_trainable(names: Any, directory: str | Path) -> None:
    """The checkpoint's trainable weights loaded in place into the model's (``names``: its ``ParamNames``)."""
    from lowmem_tpu.xla import runtime as rt
    from lowmem_tpu.xla import sharded_state

    trainable = {f"{TRAINABLE}{n}": p for n, p in names.params.items() if p.requires_grad}
    sharded_state.load_into(trainable, Path(directory) / STATE)
    rt.sync()


def load_optimizer_and_scheduler(
    optimizer: Any, scheduler: Any, directory: str | Path, runtime: Any, strategy: str
) -> None:
    """The optimizer's state restored straight into tensors placed like their parameters (any device count)."""
    from lowmem_tpu.xla import runtime as rt
    from lowmem_tpu.xla import sharded_state

    path = Path(directory)
    optimizer.load_state_dict({"state": {}, "param_groups": torch.load(path / GROUPS, weights_only=True)})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets = _optimizer_targets(read_metadata(path), optimizer, params, runtime, strategy)
    sharded_state.load_into(targets, path / STATE)
    restore_checkpoint_state(optimizer, optimizer_state_of(targets), params)
    scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=True))
    rt.sync()


def _optimizer_targets(
    saved: dict[str, Any], optimizer: Any, params: list[torch.Tensor], runtime: Any, strategy: str
) -> dict[str, Any]:
    """Where each saved optimizer entry goes: a parameter-shaped tensor placed like it, else a host one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lowmem_tpu.xla.sharding import place_like

    masters, targets = masters_of(optimizer), {}
    for key, meta in saved.items():
        if key.startswith(MASTER):
            targets[key] = masters[int(key.removeprefix(MASTER))]
        elif key.startswith(OPTIMIZER):
            param = params[int(key.removeprefix(OPTIMIZER).split("/")[0])]
            if not isinstance(meta, TensorStorageMetadata):
                targets[key] = None  # a saved object (Adafactor's step count)
                continue
            host = torch.zeros(meta.size, dtype=meta.properties.dtype)
            shaped = tuple(meta.size) == tuple(param.shape) and param.device.type == "xla"
            targets[key] = place_like(host, param, runtime, strategy) if shaped else host
    return targets
