"""Training checkpoints that are only ever used once complete.

A checkpoint is written to ``output_dir/checkpoints/step-N.partial`` and renamed to
``step-N`` after its ``COMPLETE`` marker (written last); older checkpoints are deleted only
after that. It holds the trainable state (adapter or full model, clean names, safetensors),
the optimizer and scheduler, the RNG states (python, numpy, torch, XLA: the Trainer's own
``rng_state.pth``), ``trainer_state.json`` (step and data position) and the resolved recipe.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from lowmem_tpu.errors import UserError
from lowmem_tpu.files import publish

COMPLETE = "COMPLETE"
WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
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


def resolve_resume(setting: str, output_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` (latest complete, if any), ``never``, or a path."""
    if setting == "never":
        return None
    if setting == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(setting).expanduser()
    if not (path / COMPLETE).exists():
        raise UserError(f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker)")
    return path


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


def save_trainable(state: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / WEIGHTS))


def load_trainable(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / WEIGHTS))


def finish(partial: Path, keep_last: int) -> Path:
    """Mark a written checkpoint complete, publish it, then prune the oldest complete ones."""
    (partial / COMPLETE).write_text("ok\n")
    final = partial.with_name(partial.name.removesuffix(".partial"))
    publish(partial, final)
    for old in complete_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old)
    return final
