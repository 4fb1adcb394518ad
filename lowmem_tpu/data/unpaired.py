"""Unpaired preference rows (KTO): a prompt, one completion and whether it is desirable, as one row of exactly
``data.max_length`` tokens; the KL rows each batch needs are made when it is collated.

TRL's unpaired format (``prompt``/``completion``/``label``, strings or lists of messages, the label a
boolean), or preference pairs read as TRL's ``KTOTrainer`` reads them (``unpair_preference_dataset``: each
pair two rows, prompt + chosen desirable and prompt + rejected undesirable; in each block of 1000 pairs
every chosen row first). Tokenized as the pairs are (``data.pairs``: TRL's rule, the completion from where
the prompt's tokens and the joined text's part); ``data.too_long`` as for pairs.

KTO estimates its KL term from mismatched rows: each prompt with the completion of the batch's previous row
(TRL's ``KL_completion_ids``: the completions rotated by one within the batch), cut at ``data.max_length``
from the right, as TRL's collator cuts them. With the reference precomputed the KL rows are fixed once, per
block of a micro-batch's rows in the dataset's order, as TRL's dataset fixes them (``with_kl_rows``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lowmem_tpu.data.fields as fields
from lowmem_tpu.config import DataSection
from lowmem_tpu.data.pairs import BATCH, FIX, joined_texts, record_parts, split_completions, truncated_pair
from lowmem_tpu.data.sources import DataError, length_percentiles

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import torch

ROW_COLUMNS = ("input_ids", "attention_mask", "completion_mask")
KL_COLUMNS = tuple(f"KL_{name}" for name in ROW_COLUMNS)
REFERENCE_COLUMNS = ("ref_logps", "ref_KL_logps")  # TRL's: the reference on the rows and on their KL rows
Row = tuple[list[int], list[int], bool]  # prompt ids, completion ids, desirable


def _parts(record: dict[str, Any], cfg: DataSection, where: str) -> list[tuple[Any, Any, bool]]:
    """(prompt, completion, desirable) of a record: one for the unpaired format, two for a pair."""
    if cfg.format == "preference":
        prompt, chosen, rejected = record_parts(record, cfg, where)
        return [(prompt, chosen, True), (prompt, rejected, False)]
    values = {}
    for field in ("prompt", "completion"):
        name, value = fields.column(cfg, field), record.get(fields.column(cfg, field))
        if not isinstance(value, str | list) or not value:
            raise DataError(
                f"{where}: column {name!r} ({field}) must be a non-empty string or list of messages, not "
                f"{fields.show(value)}; {FIX}, or name the column that holds it: data.columns: {{{field}: COLUMN}}"
            )
        values[field] = value if isinstance(value, str) else fields.as_messages(value, f"{where}: column {name!r}")
    if isinstance(values["prompt"], str) != isinstance(values["completion"], str):
        raise DataError(f"{where}: prompt and completion must both be strings or both lists of messages; {FIX}")
    label_name = fields.column(cfg, "label")
    label = record.get(label_name)
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: column {label_name!r} (label) must be true (a desirable completion) or false (an undesirable "
            f"one), not {fields.show(label)}; {FIX} (JSON true/false, not strings or numbers)"
        )
    return [(values["prompt"], values["completion"], label)]


def encode_unpaired(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> list[Row]:
    """Every record as token ids, ``BATCH`` records per tokenizer call; a block's desirable rows first."""
    rows: list[Row] = []
    for first in range(0, len(records), BATCH):
        chunk = records.select(range(first, min(first + BATCH, len(records))))
        parts = [p for i, r in enumerate(chunk, first + 1) for p in _parts(r, cfg, f"{source}: record {i}")]
        if cfg.format == "preference":  # TRL's unpairing: every chosen row of the block, then every rejected one
            parts = parts[0::2] + parts[1::2]
        texts = [joined_texts(prompt, [completion], tokenizer, source) for prompt, completion, _ in parts]
        flat = tokenizer([t for group in texts for t in group], add_special_tokens=False)["input_ids"]
        for (_, _, label), index in zip(parts, range(0, len(flat), 2), strict=True):
            prompt, completion = split_completions([list(flat[index]), list(flat[index + 1])], tokenizer)
            rows.append((prompt, completion, label))
    return rows


def fit_unpaired(rows: list[Row], cfg: DataSection, source: str) -> tuple[list[Row], dict[str, Any]]:
    """``data.too_long`` applied (as for pairs: the prompt cut from the left first, then the completion)."""
    limit, kept, truncated, dropped = cfg.max_length, [], 0, 0
    for index, (prompt, completion, label) in enumerate(rows, 1):
        if len(prompt) + len(completion) <= limit:
            kept.append((prompt, completion, label))
        elif cfg.too_long == "drop":
            dropped += 1
        elif len(prompt) >= limit or cfg.too_long == "error":
            raise DataError(
                f"{source}: row {index}: prompt + completion is {len(prompt) + len(completion)} tokens (the prompt "
                f"{len(prompt)}), longer than data.max_length={limit}; raise data.max_length, or set data.too_long: "
                "drop" + (" or truncate" if len(prompt) < limit else "")
            )
        else:
            cut_prompt, cut, _ = truncated_pair(prompt, completion, completion, limit)
            kept.append((cut_prompt, cut, label))
            truncated += 1
    if not kept:
        raise DataError(f"{source}: all {len(rows)} rows are longer than data.max_length={limit}; raise it")
    lengths = [len(p) + len(c) for p, c, _ in rows]
    counts = {"truncated": truncated, "dropped": dropped, "dropped_too_long": dropped, "dropped_untrained": 0}
    return kept, counts | {"longest": max(lengths), "lengths": length_percentiles(lengths)}


def unpaired_rows(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> tuple[dict, dict]:
    """Rows and stats for KTO (``rows.build_dataset``'s with ``unpaired``)."""
    import numpy as np

    rows = encode_unpaired(records, cfg, tokenizer, source)
    kept, counts = fit_unpaired(rows, cfg, source)
    arrays = {name: np.zeros((len(kept), cfg.max_length), dtype=np.int32) for name in ROW_COLUMNS}
    arrays["input_ids"][:] = tokenizer.pad_token_id
    for row, (prompt, completion, _) in enumerate(kept):
        _place(arrays, row, prompt, completion)
    arrays["label"] = np.array([label for _, _, label in kept], dtype=bool)
    desirable = int(arrays["label"].sum())
    stats = {"samples": len(records), "rows": len(kept), "desirable": desirable, "undesirable": len(kept) - desirable}
    stats |= counts | {"tokens": int(arrays["attention_mask"].sum())}
    return arrays, stats | {"trained_tokens": int(arrays["completion_mask"].sum())}


def _place(arrays: dict[str, np.ndarray], row: int, prompt: list[int], completion: list[int], prefix: str = "") -> None:
    ids = (prompt + completion)[: arrays[f"{prefix}input_ids"].shape[1]]
    arrays[f"{prefix}input_ids"][row, : len(ids)] = ids
    arrays[f"{prefix}attention_mask"][row, : len(ids)] = 1
    arrays[f"{prefix}completion_mask"][row, len(prompt) : len(ids)] = 1


def collate_unpaired(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A KTO batch at a static shape: the rows ``[batch, max_length]``, ``label`` ``[batch]`` (bool), and the KL
    rows: those the rows carry (``with_kl_rows``), else made here (``kl_rows``); the reference's log-probabilities
    where precomputed."""
    import numpy as np
    import torch

    if not rows:
        raise ValueError("collate_unpaired needs at least one row")
    carried = KL_COLUMNS if KL_COLUMNS[0] in rows[0] else ()
    arrays = {key: np.array([row[key] for row in rows], dtype=np.int64) for key in (*ROW_COLUMNS, *carried)}
    batch = {key: torch.from_numpy(value) for key, value in (arrays if carried else arrays | kl_rows(arrays)).items()}
    batch["label"] = torch.tensor([bool(row["label"]) for row in rows])
    for key in (key for key in REFERENCE_COLUMNS if key in rows[0]):
        batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
    return batch


def kl_rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """KTO's KL rows for a batch of rows: row i's prompt with row i-1's completion (row 0 with the last's), cut
    at ``max_length`` (TRL's ``KL_completion_ids``)."""
    import numpy as np

    kl = {f"KL_{key}": np.zeros_like(arrays[key]) for key in ROW_COLUMNS}
    kl["KL_input_ids"][:] = arrays["input_ids"][:, -1:]  # past the row: any token (masked), the pad id mostly
    parts = list(zip(arrays["input_ids"], arrays["attention_mask"], arrays["completion_mask"], strict=True))
    prompts = [ids[(mask == 1) & (done == 0)].tolist() for ids, mask, done in parts]
    completions = [ids[done == 1].tolist() for ids, _, done in parts]
    for row, prompt in enumerate(prompts):
        _place(kl, row, prompt, completions[row - 1], prefix="KL_")
    return kl


def with_kl_rows(dataset: datasets.Dataset, block: int) -> datasets.Dataset:
    """``dataset`` with fixed KL rows, each block of ``block`` rows (a micro-batch) paired as ``kl_rows`` pairs a
    batch: TRL's ``KTOTrainer`` dataset, whose KL rows a precomputed reference scores once."""
    import numpy as np

    if KL_COLUMNS[0] in dataset.column_names:
        return dataset

    def add(batch: dict[str, list]) -> dict[str, list]:
        arrays = {key: np.array(batch[key], dtype=np.int64) for key in ROW_COLUMNS}
        return {key: value.astype(np.int32).tolist() for key, value in kl_rows(arrays).items()}

    # in memory: every host of a pod slice makes the same rows, none writes a cache file beside the dataset's
    return dataset.map(add, batched=True, batch_size=block, keep_in_memory=True, desc=None)
