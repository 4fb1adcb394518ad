"""Preference pairs: a record becomes a prompt, a chosen and a rejected completion, then two rows of exactly
``data.max_length`` tokens (prompt + chosen, prompt + rejected) with the completion's positions marked.

TRL's preference formats: ``prompt``/``chosen``/``rejected`` as plain strings or as lists of messages, and the
implicit prompt (``chosen`` and ``rejected`` conversations, or texts, sharing a prefix: TRL's
``maybe_extract_prompt`` splits it off). Tokenized as TRL's ``DPOTrainer`` does (``_prepare_dataset``):
plain texts are the prompt, then prompt + completion with EOS once at its end; conversations are the prompt
rendered with the generation prompt, then prompt + completion rendered whole. The completion starts where
the prompt's tokens and the joined text's first differ, so a token that joins the two is trained.

What does not fit ``data.max_length`` follows ``data.too_long``: ``truncate`` cuts the prompt from the left
first (its BOS kept), then both completions from the right; ``drop`` leaves the pair out; ``error`` stops.
A prompt that alone fills ``max_length`` leaves nothing to compare: it stops the run unless ``drop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lowmem_tpu.data.fields as fields
from lowmem_tpu.config import DataSection
from lowmem_tpu.data.chat import common_prefix, render, served
from lowmem_tpu.data.formats import led_by_bos
from lowmem_tpu.data.sources import DataError, length_percentiles

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import torch

PAIR_COLUMNS = ("input_ids", "attention_mask", "completion_mask")  # each [2, max_length]: chosen, rejected
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's, where the reference is precomputed
FIX = "fix or remove that record"
BATCH = 1000  # records tokenized per tokenizer call

Pair = tuple[list[int], list[int], list[int]]  # prompt ids, chosen ids, rejected ids


def record_parts(record: dict[str, Any], cfg: DataSection, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a record: three strings, or three lists of messages (an implicit
    prompt split off the shared start of chosen and rejected)."""
    from trl.data_utils import maybe_extract_prompt

    example = {}
    for field in ("chosen", "rejected"):
        name = fields.column(cfg, field)
        value = record.get(name)
        if not isinstance(value, str | list) or not value:
            raise DataError(
                f"{where}: column {name!r} ({field}) must be a non-empty string or list of messages, not "
                f"{fields.show(value)}; {FIX}, or name the column that holds it: data.columns: {{{field}: COLUMN}}"
            )
        example[field] = value if isinstance(value, str) else fields.as_messages(value, f"{where}: column {name!r}")
    plain = isinstance(example["chosen"], str)
    prompt = record.get(fields.column(cfg, "prompt"))
    # A text prompt beside conversations that hold it (HuggingFaceH4's UltraFeedback): the shared turns are
    # the prompt, as TRL's maybe_extract_prompt reads such a record
    if prompt is not None and not (isinstance(prompt, str) and not plain):
        example["prompt"] = prompt if isinstance(prompt, str) else fields.as_messages(prompt, f"{where}: prompt")
    if any(isinstance(value, str) != plain for value in example.values()):
        raise DataError(f"{where}: prompt, chosen and rejected must all be strings or all lists of messages; {FIX}")
    example = maybe_extract_prompt(example)
    if example["chosen"] == example["rejected"]:
        raise DataError(f"{where}: chosen and rejected are the same, so there is no preference to learn; {FIX}")
    if not example["chosen"] or not example["rejected"]:
        raise DataError(f"{where}: one completion is all prompt (nothing after what chosen and rejected share); {FIX}")
    if not plain and not example["prompt"]:
        raise DataError(f"{where}: the conversations share no prompt: give a prompt column; {FIX}")
    return example["prompt"], example["chosen"], example["rejected"]


def _texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    """[prompt, prompt + chosen, prompt + rejected] as the texts to tokenize."""
    prompt, chosen, rejected = record_parts(record, cfg, where)
    return joined_texts(prompt, [chosen, rejected], tokenizer, where)


def joined_texts(prompt: Any, completions: list[Any], tokenizer: Any, where: str) -> list[str]:
    """[prompt, prompt + each completion] as TRL's trainers tokenize them: plain texts with EOS once at each
    completion's end; conversations rendered, the prompt with the generation prompt."""
    if isinstance(prompt, str):
        eos = tokenizer.eos_token
        return [prompt, *(prompt + (c if c.endswith(eos) else c + eos) for c in completions)]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: conversational preference data is rendered with a chat template and the tokenizer has "
            "none: set data.chat_template (plain or chatml, shipped, or a Jinja file)"
        )
    return [render(tokenizer, prompt, True, where), *(served(tokenizer, prompt, c, where) for c in completions)]


def split_completions(ids: list[list[int]], tokenizer: Any) -> tuple[list[int], ...]:
    """(prompt, each completion) ids from [prompt, prompt + each completion]: each led by the BOS the tokenizer
    puts first (as TRL's tokenization with special tokens, or a template that writes it), the completions from
    where the texts part."""
    prompt, *joined = (led_by_bos(tokenizer, part) for part in ids)
    start = min(common_prefix(prompt, text) for text in joined)
    return prompt[:start], *(text[start:] for text in joined)


def _pair(ids: list[list[int]], tokenizer: Any) -> Pair:
    prompt, chosen, rejected = split_completions(ids, tokenizer)
    return prompt, chosen, rejected


def encode_pairs(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> list[Pair]:
    """Every record as token ids, ``BATCH`` records per tokenizer call."""
    pairs = []
    for first in range(0, len(records), BATCH):
        chunk = records.select(range(first, min(first + BATCH, len(records))))
        texts = [_texts(record, cfg, tokenizer, f"{source}: record {first + i}") for i, record in enumerate(chunk, 1)]
        flat = tokenizer([t for group in texts for t in group], add_special_tokens=False)["input_ids"]
        pairs += [_pair([list(ids) for ids in flat[i : i + 3]], tokenizer) for i in range(0, len(flat), 3)]
    return pairs


def fit_pairs(pairs: list[Pair], cfg: DataSection, source: str) -> tuple[list[Pair], dict[str, Any]]:
    """``data.too_long`` applied: the pairs that fit (cut where ``truncate``) and the counts."""
    limit, kept, truncated, dropped = cfg.max_length, [], 0, 0
    for index, (prompt, chosen, rejected) in enumerate(pairs, 1):
        longest = max(len(chosen), len(rejected))
        if len(prompt) + longest <= limit:
            kept.append((prompt, chosen, rejected))
            continue
        if cfg.too_long == "drop":
            dropped += 1
            continue
        fix = "raise data.max_length, or set data.too_long: drop"
        if len(prompt) >= limit:
            raise DataError(
                f"{source}: record {index}: the prompt alone is {len(prompt)} tokens, data.max_length is {limit}, "
                f"so no completion token is left to compare; {fix}"
            )
        if cfg.too_long == "error":
            raise DataError(
                f"{source}: record {index}: prompt + completion is {len(prompt) + longest} tokens, longer than "
                f"data.max_length={limit}; {fix} or truncate"
            )
        kept.append(truncated_pair(prompt, chosen, rejected, limit))
        truncated += 1
    if not kept:
        raise DataError(
            f"{source}: all {len(pairs)} pairs are longer than data.max_length={limit} (data.too_long: drop); raise it"
        )
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in pairs]
    counts = {"truncated": truncated, "dropped": dropped, "dropped_too_long": dropped, "dropped_untrained": 0}
    return kept, counts | {"longest": max(lengths), "lengths": length_percentiles(lengths)}


def truncated_pair(prompt: list[int], chosen: list[int], rejected: list[int], limit: int) -> Pair:
    """The prompt cut from the left (down to half the row at most, its first token kept), then the
    completions from the right."""
    longest = max(len(chosen), len(rejected))
    keep = max(limit - longest, min(len(prompt), limit // 2))
    if keep < len(prompt):
        prompt = prompt[:1] + prompt[len(prompt) - keep + 1 :]
    room = limit - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def pair_rows(pairs: list[Pair], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """``[pairs, 2, length]`` arrays: prompt + chosen, prompt + rejected, right-padded with ``pad_id``."""
    import numpy as np

    arrays = {name: np.zeros((len(pairs), 2, length), dtype=np.int32) for name in PAIR_COLUMNS}
    arrays["input_ids"][:] = pad_id
    for row, (prompt, *completions) in enumerate(pairs):
        for side, completion in enumerate(completions):
            ids = prompt + completion
            arrays["input_ids"][row, side, : len(ids)] = ids
            arrays["attention_mask"][row, side, : len(ids)] = 1
            arrays["completion_mask"][row, side, len(prompt) : len(ids)] = 1
    return arrays


def preference_rows(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> tuple[dict, dict]:
    """Rows and stats of preference records (``rows.build_dataset``'s for format preference)."""
    pairs = encode_pairs(records, cfg, tokenizer, source)
    kept, counts = fit_pairs(pairs, cfg, source)
    arrays = pair_rows(kept, cfg.max_length, tokenizer.pad_token_id)
    stats = {
        "samples": len(pairs),
        "rows": len(kept),
        **counts,
        "tokens": int(arrays["attention_mask"].sum()),
        "trained_tokens": int(arrays["completion_mask"].sum()),
    }
    return arrays, stats


def collate_pairs(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """TRL's preference batch at a static shape: ``[2 x batch, max_length]``, every chosen row first, then
    every rejected row in the same order (``DataCollatorForPreference``'s layout), as LongTensors; precomputed
    reference log-probabilities (TRL's ``ref_chosen_logps`` columns) as float32 ``[batch]``."""
    import torch

    if not rows:
        raise ValueError("collate_pairs needs at least one row")
    batch: dict[str, Any] = {}
    for key in PAIR_COLUMNS:
        stacked = torch.stack([torch.as_tensor(row[key], dtype=torch.long) for row in rows])  # [batch, 2, length]
        batch[key] = stacked.transpose(0, 1).reshape(-1, stacked.shape[-1])
    for key in REFERENCE_COLUMNS if REFERENCE_COLUMNS[0] in rows[0] else ():
        batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
    return batch


def preference_prompts(
    records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str, n: int
) -> list[tuple[list[int], str]]:
    """The first ``n`` records as (prompt ids, the chosen answer): what greedy exact match expects. Plain: the
    ids before the chosen completion, the rest of it as text; conversations: the prompt with the generation
    prompt, the chosen reply's content."""
    out = []
    for index, record in enumerate(records.select(range(min(max(n, 0), len(records)))), 1):
        where = f"{source}: record {index}"
        prompt, chosen, _ = record_parts(record, cfg, where)
        if isinstance(prompt, str):
            ids = [list(i) for i in tokenizer([prompt, prompt + chosen], add_special_tokens=False)["input_ids"]]
            start, completion, _ = _pair([ids[0], ids[1], ids[1]], tokenizer)
            out.append((start, tokenizer.decode(completion, skip_special_tokens=True)))
        else:
            text = _texts(record, cfg, tokenizer, where)[0]
            ids = list(tokenizer([text], add_special_tokens=False)["input_ids"][0])
            out.append((_pair([ids, ids, ids], tokenizer)[0], chosen[-1]["content"]))
    return out
