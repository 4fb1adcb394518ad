"""Training checkpoints that are only ever used once complete.

A checkpoint is written to ``output_dir/checkpoints/step-N.partial`` and renamed to
``step-N`` after its ``COMPLETE`` marker (written last); older checkpoints are deleted only
after that. ``state/`` holds the sharded tensors in ``torch.distributed.checkpoint`` form, each
host writing its own shards (``xla.sharded_state``): the trainable weights (``trainable/NAME``,
clean names), the optimizer's state (``optimizer/I/KEY``) and fp32 master weights (``master/J``).
Beside it, written by host 0: the optimizer's param groups, the scheduler, the RNG states (the
Trainer's own ``rng_state.pth``), ``trainer_state.json`` (step and data position), the resolved
recipe, and what ``lowmem-tpu export`` needs to turn the checkpoint into an adapter or a model
(``export/``: the adapter's config and key map, or the model's config; the tokenizer).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from lowmem_tpu import faults
from lowmem_tpu.errors import UserError
from lowmem_tpu.files import damage, publish, write_manifest
from lowmem_tpu.train.master import MASTERS

COMPLETE = "COMPLETE"
STATE = "state"
GROUPS = "optimizer_groups.pt"
EXPORT = "export"
ADAPTER_KEYS = "adapter_keys.json"
TRAINABLE, OPTIMIZER, MASTER = "trainable/", "optimizer/", "master/"
SAVE_MARGIN = 2**20  # a checkpoint's small files beside its tensors (tokenizer, configs, RNG, metadata)
SCHEDULER = "scheduler.pt"
RECIPE = "recipe.yaml"
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


def _problem(path: Path) -> str | None:
    if not (path / STATE / ".metadata").is_file() and (path / "trainable.safetensors").is_file():
        return "written by an earlier lowmem-tpu, as one host's safetensors: resume it with that version"
    return damage(path)


def recipe_changes(checkpoint: Path, recipe_data: dict[str, Any]) -> list[str]:
    """Field-by-field differences in the fields a resumed run must keep."""
    saved = yaml.safe_load((checkpoint / RECIPE).read_text())
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


def check_room(directory: Path, needed: int, what: str) -> None:
    """A UserError before writing ``what`` when the disk under ``directory`` has less than ``needed`` free."""
    from lowmem_tpu.console import size

    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise UserError(
            f"{what} needs {size(needed)} on the disk of {directory}, which has {size(free)} free: free space "
            "there, choose another output_dir, or lower train.keep_last (nothing written so far is lost)"
        )
