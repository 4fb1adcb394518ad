"""Small rules the schema and the run share: how a batch splits over the devices, what a duration is."""

from __future__ import annotations

import re
from typing import Any

from lowmem_tpu.errors import UserError


def batch_split_problem(global_batch: int, accumulation: int, devices: int | None = None) -> str | None:
    """Why a global batch cannot be cut into ``accumulation`` micro-batches that split evenly over ``devices``
    (None: it can; ``devices`` None: only the cut into micro-batches is asked). The one statement of the rule:
    validation, ``preflight``, the planner and the run all ask it."""
    if global_batch % accumulation:
        return (
            f"train.global_batch_size: {global_batch} is not divisible by train.gradient_accumulation_steps "
            f"({accumulation})"
        )
    micro = global_batch // accumulation
    if devices is None or micro % devices == 0:
        return None
    return (
        f"train.global_batch_size: the micro-batch ({global_batch} / {accumulation} accumulation steps = "
        f"{micro}) must split evenly over {devices} devices; "
        f"use a multiple of {devices * accumulation}"
    )


def micro_batch_size(recipe: Any, devices: int) -> int:
    """Samples per forward pass over all devices of a recipe; a UserError when they do not split evenly."""
    t = recipe.train
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, devices)
    if problem:
        raise UserError(problem)
    return t.global_batch_size // t.gradient_accumulation_steps


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``8h30m``, ``45m``, ``90s`` or ``1h``."""
    match = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", str(text))
    if not match or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration like 8h30m, 45m or 90s")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600.0 + minutes * 60.0 + seconds


def loss_block(length: int) -> int:
    """Positions per block of ``train.chunked_loss``: at most 256, and at least 8 blocks per sequence
    (torchtune's chunked loss cuts into 8): 2048 tokens -> 256, 4096 -> 256, 512 -> 64."""
    return max(1, min(256, -(-length // 8)))
