"""Small rules the schema and the run share: how a batch splits over the devices, what a duration is."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from lowmem_tpu.errors import UserError

if TYPE_CHECKING:
    from lowmem_tpu.config.schema import Recipe


def batch_split_problem(global_batch: int, accumulation: int, devices: int) -> str | None:
    """Why a global batch cannot be cut into micro-batches that split evenly over the devices (None: it can)."""
    micro = global_batch // accumulation
    if micro % devices == 0:
        return None
    return (
        f"train.global_batch_size: the micro-batch ({global_batch} / {accumulation} accumulation steps = "
        f"{micro}) must split evenly over {devices} devices; "
        f"use a multiple of {devices * accumulation}"
    )


def micro_batch_size(recipe: Recipe, devices: int) -> int:
    """Samples per forward pass over all devices; a UserError when they do not split evenly."""
    t = recipe.train
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, devices)
    if t.global_batch_size % t.gradient_accumulation_steps:
        problem = (
            f"train.global_batch_size: {t.global_batch_size} is not divisible by train.gradient_accumulation_steps"
        )
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
