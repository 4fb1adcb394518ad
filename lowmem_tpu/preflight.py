"""What this machine must have before a command runs, asked by one function: :func:`preflight`.

Whether a recipe is valid is ``config.validate``'s answer and never depends on the machine; whether
this machine can run it is asked here, by each command for what it does (``validate``, ``sft``,
``memory``, ``compare`` each pass their needs). Every check raises UserError naming the fix (the
CLI's exit 2). Light to import: ``config`` and the basic modules; the platform probe is
``config.platform``'s (no torch_xla: that stays in ``xla/``); the Hub token and the model's
architecture are asked of ``publish.hub`` and ``model`` inside the function, only when needed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from pathlib import Path
from typing import Literal

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.checks import cpu_backend_problems, target_problem
from lowmem_tpu.config.platform import platform_for
from lowmem_tpu.errors import UserError

# The package each train.report_to integration needs (transformers' own callbacks import them).
INTEGRATIONS = {
    "tensorboard": ("tensorboard", "pip install 'lowmem-tpu[tensorboard]' (in a clone, make install has it)"),
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
        require_scan_extra(recipe.sharding.scan_layers, load=scan == "importable")
    if hub and recipe.hub.push:
        from lowmem_tpu.publish.hub import check_push_ready

        check_push_ready(recipe)  # a missing, rejected or read-only token fails now, not after training
    summary = None
    if model:
        from lowmem_tpu.model import check_model

        summary = check_model(recipe)
    if room:
        check_room(Path(recipe.output_dir), *room)
    return summary


def require_scan_extra(scan_layers: bool = True, load: bool = True) -> None:
    """Refuse ``sharding.scan_layers`` without the [scan] extra, before anything is built or traced.

    torch_xla 2.9's scan keeps carries sharded alike through jax (``xb.call_jax`` needs jax and torchax).
    Its wheel ships a ``torchax`` of its own, without package metadata, that imports flax: found, but it
    does not import. ``make install-scan`` installs torchax itself, with metadata. ``load=False`` checks
    the metadata only (the parent of a trace, which keeps torchax out of its process).
    """
    if not scan_layers:
        return
    try:
        importlib.metadata.version("torchax")
        if load:
            import torchax  # noqa: F401  (imports jax)
    except (importlib.metadata.PackageNotFoundError, ImportError) as err:
        unlisted = isinstance(err, importlib.metadata.PackageNotFoundError)
        found = "torchax is not installed as a package; torch_xla's bundled copy needs flax" if unlisted else err
        raise UserError(
            f"sharding.scan_layers: needs jax and torchax ({found}); install them with: make install-scan"
        ) from None


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
