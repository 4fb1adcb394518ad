"""Which records each part of a run reads: the training data, and held-out data that is never trained on.

Held-out data is ``data.eval_path`` (a file or Hub dataset, ``data.eval_split``), or, for data without
a split of its own, ``data.eval_fraction`` of the training records carved out with a fixed seed, so the
same records are held out in every run and every resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from lowmem_tpu.config import DataSection
from lowmem_tpu.data.sources import DataError, load_records

if TYPE_CHECKING:
    import datasets

Role = Literal["train", "eval"]
SPLIT_SEED = 1234


def select_records(
    cfg: DataSection, role: Role, *, path: str | None = None, split: str | None = None
) -> tuple[datasets.Dataset, str]:
    """The records of ``role`` and how to name their source in messages (``path``: read that instead)."""
    if path is not None:
        return load_records(path, split or cfg.split, cfg.subset), path
    if role == "eval" and cfg.eval_path:
        return load_records(cfg.eval_path, cfg.eval_split or cfg.split, cfg.subset), cfg.eval_path
    if role == "eval" and not cfg.eval_fraction:
        raise DataError("there is no held-out data: set data.eval_path (and data.eval_split) or data.eval_fraction")
    records = load_records(cfg.path, cfg.split, cfg.subset)
    if not cfg.eval_fraction or cfg.eval_path:
        return records, cfg.path
    return held_out(records, cfg.eval_fraction, cfg.path)[role], f"{cfg.path} ({role} part)"


def held_out(records: datasets.Dataset, fraction: float, source: str) -> dict[Role, datasets.Dataset]:
    """``fraction`` of the records (at least one) for evaluation, the rest for training, in file order."""
    import numpy as np

    count = max(1, round(len(records) * fraction))
    if count >= len(records):
        raise DataError(
            f"{source}: data.eval_fraction {fraction} of {len(records)} records leaves nothing to train on; "
            "lower it or give data.eval_path"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(len(records))
    return {"eval": records.select(sorted(order[:count])), "train": records.select(sorted(order[count:]))}
