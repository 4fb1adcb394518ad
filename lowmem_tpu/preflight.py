"""What this machine must have before a command runs, asked by one function: :func:`preflight`.

Whether a recipe is valid is ``config.validate``'s answer and never depends on the machine; whether
this machine can run it is asked here, by each command for what it does (``validate``, ``sft``,
``memory``, ``compare`` each pass their needs). Every check raises UserError naming the fix (the
CLI's exit 2). Light to import: ``config`` and the basic modules; the platform probe is
``machine``'s (no torch_xla: that stays in ``xla/``); the Hub token and the model's
architecture are asked of ``publish.hub`` and ``model`` inside the function, only when needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from lowmem_tpu.config import Recipe, with_overrides
from lowmem_tpu.config.checks import cpu_backend_problems, cpu_equivalents, target_problem
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import platform_for

# The package each train.report_to integration needs (transformers' own callbacks import them).
INTEGRATIONS = {
    "tensorboard": ("tensorboard", "pip install 'lowmem-tpu[tensorboard]' (in a clone, make install-dev has it)"),
    "wandb": ("wandb", "pip install wandb"),
}


def preflight(
    recipe: Recipe,
    *,
    platform: bool = False,
    target: bool = False,
    reporters: bool = False,
    scan: Literal["installed", "importable"] | None = None,
    hub: bool = False,
    model: bool = False,
    room: tuple[int, str] | None = None,
) -> str | None:
    """Refuse (UserError) what this machine lacks for a command on ``recipe``; each keyword is one need.

    - ``platform``: the backend ``runtime.device`` lands on here runs the recipe (on the CPU backend: the
      batch splits over ``runtime.num_cpu_devices``, no flash attention).
    - ``target``: the batch splits over the devices of the ``runtime.target`` TPU.
    - ``reporters``: the packages of ``train.report_to`` are installed.
    - ``scan``: with ``sharding.scan_layers``, the [scan] extra is here: ``"installed"`` reads its package
      metadata only (a parent that keeps jax out of its process), ``"importable"`` imports torchax too.
    - ``hub``: with ``hub.push``, the Hub token works and may write to ``hub.repo_id`` (asks the Hub).
    - ``model``: the model's architecture takes the recipe (positions, attention, loss, quantization, layer
      class, LoRA targets), read from its config offline; the one-line summary is returned.
    - ``room``: (bytes, what): the disk under ``output_dir`` has that much free for ``what``.

    The checks run in this order; the first that fails raises. Returns the model's summary, else None.
    """
    if platform and platform_for(recipe.runtime.device) == "CPU":
        problems = [message for _, message in cpu_backend_problems(recipe)]
        if problems:
            raise UserError(problems)
    if target and (problem := target_problem(recipe)):
        raise UserError(problem)
    if reporters:
        check_reporters(recipe.train.reporters)
    if scan:
        from lowmem_tpu.xla.extras import require_scan_extra

        require_scan_extra(recipe.sharding.scan_layers, load=scan == "importable")
    if hub and recipe.hub.push:
        from lowmem_tpu.publish.hub import check_push_ready

        check_push_ready(recipe)  # a missing, rejected or read-only token fails now, not after training
    summary = None
    if model:
        from lowmem_tpu.model import check_model

        summary = check_model(recipe)
    if room:
        from lowmem_tpu.files import check_room

        check_room(Path(recipe.output_dir), *room)
    return summary


def as_run_here(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe as this machine runs it, and a line for each change: on the CPU backend (a rehearsal of a
    TPU recipe) each TPU-only setting becomes its CPU equivalent (``config.checks.cpu_equivalents``)."""
    if platform_for(recipe.runtime.device) != "CPU":
        return recipe, []
    swaps = cpu_equivalents(recipe)
    if not swaps:
        return recipe, []
    notes = [f"on the CPU backend: {field}={value} ({why})" for field, value, why in swaps]
    return with_overrides(recipe, [f"{field}={value}" for field, value, _ in swaps]), notes


def check_reporters(reporters: list[str]) -> None:
    """A UserError naming the missing package and the command that installs it, before anything loads."""
    missing = [
        (name, *INTEGRATIONS[name]) for name in reporters if importlib.util.find_spec(INTEGRATIONS[name][0]) is None
    ]
    if missing:
        raise UserError(
            [
                f"train.report_to: {name} needs the {package} package, which is not installed: {fix} "
                "(or drop it from train.report_to)"
                for name, package, fix in missing
            ]
        )
