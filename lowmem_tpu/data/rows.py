"""Static shapes: formatted samples become rows of exactly ``data.max_length`` tokens.

XLA compiles one graph per input shape, so every row this module returns has
exactly ``data.max_length`` tokens: a ragged batch would recompile the step (minutes
on a TPU) for every new length. Padding is wasted compute; ``data.packing`` puts
several samples in a row, each attending only to itself.

Labels are not shifted (the model shifts them) and are ``-100`` wherever nothing
should be learned: padding, and with ``data.mask_prompt`` the prompt. Padding is
found by position, never by comparing ids with the pad id, because the pad token
may be the EOS, which must still be learned.

``datasets``, ``numpy`` and ``torch`` are imported inside the functions that use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import lowmem_tpu.data.cache as cache
from lowmem_tpu.config import DataSection, with_fields
from lowmem_tpu.data.formats import (
    IGNORE_INDEX,
    Sample,
    check_tokenizer,
    encode_records,
    prompt_answer_pairs,
    require_columns,
)
from lowmem_tpu.data.pairs import preference_prompts, preference_rows
from lowmem_tpu.data.sources import DataError, length_percentiles
from lowmem_tpu.data.splits import Role, select_records
from lowmem_tpu.data.unpaired import unpaired_rows

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import torch

COLUMNS = ("input_ids", "attention_mask", "labels")
PACKED = ("position_ids", "segment_ids")  # the extra columns of packed rows


# --------------------------------------------------------------------------- static shapes


def build_dataset(
    cfg: DataSection,
    tokenizer: Any,
    *,
    role: Role = "train",
    path: str | None = None,
    split: str | None = None,
    max_samples: int | None = None,
    cache_dir: Path | None = None,
    digest: bool = False,
    unpaired: bool = False,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Load, format and tokenize one part of the data into rows of exactly ``cfg.max_length`` tokens.

    ``role`` picks the records (``splits.select_records``: the training data, or the held-out data
    of ``data.eval_path`` or ``data.eval_fraction``); ``path``/``split`` read another file instead.
    Every row has ``input_ids``, ``attention_mask`` and ``labels`` (int32; unshifted, -100 on padding
    and masked prompts), right-padded with the pad token. Samples longer than max_length follow
    ``cfg.too_long`` (with packing too: a split sample would lose its prompt); samples with no trained
    token left are dropped. With ``cfg.packing`` whole samples share rows, kept apart by ``segment_ids``
    and restarting ``position_ids`` (see ``_pack``).
    ``unpaired``: rows for KTO (``data.unpaired``: one completion per row and its label; preference pairs
    unpaired). With ``cache_dir`` the rows are kept on disk, keyed by the records, the tokenizer and the settings,
    and read back instead of tokenizing again.

    Returns the dataset and stats: samples (records read), rows, truncated, dropped (dropped_too_long:
    by ``too_long: drop``; dropped_untrained: with no trained token, e.g. a conversation without an
    assistant turn or an answer cut off), longest (tokens of the longest sample), lengths (percentiles),
    tokens (real tokens in the rows), trained_tokens (labels that are not -100),
    and cached (whether the rows came from the cache); with ``digest`` also rows_sha256, a hash of every
    row that the hosts of a pod slice compare (1.4 s for 51,760 rows of 1024 tokens, so only when asked).
    """
    import datasets

    check_tokenizer(tokenizer, cfg)
    records, source = select_records(cfg, role, path=path, split=split)
    require_columns(records, cfg, source)
    limit = max_samples if max_samples is not None else cfg.max_samples
    if limit is not None:
        records = records.select(range(min(limit, len(records))))
    if not len(records):
        raise DataError(f"{source}: no records to train on")
    settings = cfg.model_dump(exclude={"eval_path", "eval_split"}) | {"role": role, "source": source, "limit": limit}
    settings |= {"unpaired": True} if unpaired else {}
    key = cache.cache_key(records._fingerprint, tokenizer, settings)
    found = cache.load(cache_dir, key)
    if found is None:
        make = unpaired_rows if unpaired else preference_rows if cfg.format == "preference" else _rows
        arrays, stats = make(records, cfg, tokenizer, source)
        cache.save(cache_dir, key, arrays, stats)
    else:
        arrays, stats = found
    hashed = {"rows_sha256": rows_digest(arrays)} if digest else {}
    return datasets.Dataset.from_dict(arrays), {**stats, **hashed, "cached": found is not None}


def rows_digest(arrays: dict[str, Any]) -> str:
    """A short hash of every row's tokens and labels: what the hosts of a pod slice compare."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()[:16]


def exact_match_prompts(
    cfg: DataSection, tokenizer: Any, path: str | None, n: int, *, split: str | None = None
) -> list[tuple[list[int], str]]:
    """The first ``n`` held-out records (``path``: of that file) as (prompt token ids, expected answer)."""
    check_tokenizer(tokenizer, cfg)
    records, source = select_records(cfg, "eval", path=path, split=split or cfg.eval_split)
    if cfg.format == "preference":
        require_columns(records, cfg, source)
        return preference_prompts(records, cfg, tokenizer, source, n)
    if cfg.format == "unpaired":  # the desirable completions are the answers
        require_columns(records, cfg, source)
        label = cfg.columns.get("label", "label")
        records = records.filter(lambda record: record[label] is True)
        cfg = with_fields(cfg, format="prompt_completion")
    return prompt_answer_pairs(records, cfg, tokenizer, source, n)


def _rows(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> tuple[dict, dict]:
    samples = list(encode_records(records, cfg, tokenizer, source))
    kept, counts = _fit(samples, cfg)
    arrays = (_pack if cfg.packing else _pad)(kept, cfg.max_length, tokenizer.pad_token_id)
    stats = {
        "samples": len(samples),
        "rows": len(arrays["input_ids"]),
        **counts,
        "tokens": int(arrays["attention_mask"].sum()),
        "trained_tokens": int((arrays["labels"] != IGNORE_INDEX).sum()),
    }
    return arrays, stats


def _fit(samples: list[Sample], cfg: DataSection) -> tuple[list[Sample], dict[str, int]]:
    """Apply ``cfg.too_long`` and drop samples with nothing to train; return the kept samples and the counts."""
    limit = cfg.max_length
    lengths = [len(ids) for ids, _ in samples]
    too_long = sum(length > limit for length in lengths)
    if too_long and cfg.too_long == "error":
        raise DataError(
            f"{too_long} of {len(samples)} samples are longer than data.max_length={limit} tokens "
            f"(the longest has {max(lengths)}); raise data.max_length or set data.too_long: truncate or drop"
        )
    dropped_long = too_long if cfg.too_long == "drop" else 0
    if cfg.too_long == "drop":
        samples = [sample for sample in samples if len(sample[0]) <= limit]
    else:
        samples = [(ids[:limit], labels[:limit]) for ids, labels in samples]
    trained = [bool((labels != IGNORE_INDEX).any()) for _, labels in samples]
    kept = [sample for sample, keep in zip(samples, trained, strict=True) if keep]
    untrained = len(samples) - len(kept)
    # Of the kept samples: one truncated to nothing trained counts as dropped. (With drop, none is truncated.)
    truncated = 0 if dropped_long else sum(k and n > limit for k, n in zip(trained, lengths, strict=True))
    if not kept:
        reasons = [f"{untrained} had no trained token (no assistant turn, or the answer was truncated away)"]
        if dropped_long:
            reasons.insert(0, f"{dropped_long} were longer than data.max_length={limit} (data.too_long: drop)")
        raise DataError(
            f"no samples left to train on: of {len(lengths)}, {' and '.join(reasons)}; "
            "check the data or raise data.max_length"
        )
    counts = {
        "truncated": truncated,
        "dropped": dropped_long + untrained,
        "dropped_too_long": dropped_long,
        "dropped_untrained": untrained,
        "longest": max(lengths),
        "lengths": length_percentiles(lengths),
    }
    return kept, counts


def describe_cuts(stats: dict[str, Any]) -> str:
    """ "2 truncated, 3 dropped (1 too long, 2 with nothing to train)": what became of the samples that did not fit."""
    why = [
        f"{stats[key]} {reason}"
        for key, reason in (("dropped_too_long", "too long"), ("dropped_untrained", "with nothing to train"))
        if stats.get(key)
    ]
    return f"{stats['truncated']} truncated, {stats['dropped']} dropped" + (f" ({', '.join(why)})" if why else "")


def _pad(samples: list[Sample], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One right-padded row per sample."""
    arrays = _empty(len(samples), length, pad_id)
    for row, (ids, labels) in enumerate(samples):
        arrays["input_ids"][row, : len(ids)] = ids
        arrays["attention_mask"][row, : len(ids)] = 1
        arrays["labels"][row, : len(ids)] = labels
    return arrays


def _pack(samples: list[Sample], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Whole samples, in order, into rows of ``length`` (a sample that does not fit starts a new row).

    Each sample keeps to itself: ``segment_ids`` numbers the samples of a row (1, 2, ...; 0 is
    padding) for the attention mask, ``position_ids`` restart at 0 for each sample, and the
    label of a sample's first token is -100 (it would be the target of the previous sample's last
    token). The loss then sees exactly the terms of the samples trained one per row.
    """
    import numpy as np

    rows: list[list[Sample]] = [[]]
    used = 0
    for sample in samples:
        if used + len(sample[0]) > length:
            rows.append([])
            used = 0
        rows[-1].append(sample)
        used += len(sample[0])
    arrays = _empty(len(rows), length, pad_id)
    arrays["position_ids"] = np.zeros((len(rows), length), dtype=np.int32)
    arrays["segment_ids"] = np.zeros((len(rows), length), dtype=np.int32)
    for row, packed in enumerate(rows):
        start = 0
        for segment, (ids, labels) in enumerate(packed, start=1):
            stop = start + len(ids)
            arrays["input_ids"][row, start:stop] = ids
            arrays["attention_mask"][row, start:stop] = 1
            arrays["labels"][row, start:stop] = labels
            arrays["labels"][row, start] = IGNORE_INDEX
            arrays["position_ids"][row, start:stop] = np.arange(len(ids))
            arrays["segment_ids"][row, start:stop] = segment
            start = stop
        arrays["position_ids"][row, start:] = np.arange(length - start)  # padding: a run of its own
    return arrays


def _empty(rows: int, length: int, pad_id: int) -> dict[str, np.ndarray]:
    import numpy as np

    return {
        "input_ids": np.full((rows, length), pad_id, dtype=np.int32),
        "attention_mask": np.zeros((rows, length), dtype=np.int32),
        "labels": np.full((rows, length), IGNORE_INDEX, dtype=np.int32),
    }


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack rows of ``build_dataset`` into LongTensors ``[batch, max_length]`` (packed rows: with their
    ``position_ids`` and ``segment_ids``)."""
    import torch

    if not rows:
        raise ValueError("collate needs at least one row")
    keys = [*COLUMNS, *(key for key in PACKED if key in rows[0])]
    return {key: torch.stack([torch.as_tensor(row[key], dtype=torch.long) for row in rows]) for key in keys}
