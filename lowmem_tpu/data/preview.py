"""``lowmem-tpu data``: the first records as the model will see them, before paying for a run.

Each record is formatted and tokenized exactly as training does (``formats.encode_records``; a preference
pair as its two rows, ``preference.encode_pairs``), then
decoded back in spans: the tokens that are trained and the ones that are masked. The whole data set
goes through ``rows.build_dataset`` for the counts (truncated, dropped, lengths), into the run's own
tokenization cache, so the ``sft`` that follows reads the rows instead of tokenizing them again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.data.formats import IGNORE_INDEX, check_tokenizer, encode_records, require_columns
from lowmem_tpu.data.pairs import Pair, encode_pairs, truncated_pair
from lowmem_tpu.data.rows import build_dataset
from lowmem_tpu.data.splits import select_records
from lowmem_tpu.data.unpaired import Row, encode_unpaired


@dataclass
class Shown:
    """One record as the model sees it: its text in spans, trained or masked, and its fate."""

    record: int
    tokens: int
    trained: int
    fate: str  # fits, truncated, dropped: too long, dropped: nothing to train
    spans: list[tuple[bool, str]] = field(default_factory=list)  # (trained, text), in order
    side: str = ""  # preference pairs: chosen or rejected (each record is shown as its two rows)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.spans)


def first_records(cfg: DataSection, tokenizer: Any, rows: int) -> tuple[str, list[dict[str, Any]]]:
    """The training data's source and its first ``rows`` records shown (``Shown`` as dicts, with the text)."""
    check_tokenizer(tokenizer, cfg)
    records, source = select_records(cfg, "train")
    require_columns(records, cfg, source)
    first = records.select(range(min(rows, len(records))))
    if cfg.format == "unpaired":  # KTO's rows: one completion each, desirable or not
        rows = encode_unpaired(first, cfg, tokenizer, source)
        shown = [_show_unpaired(i, row, cfg, tokenizer) for i, row in enumerate(rows, 1)]
    elif cfg.format == "preference":
        pairs = encode_pairs(first, cfg, tokenizer, source)
        shown = [row for i, pair in enumerate(pairs, 1) for row in _show_pair(i, pair, cfg, tokenizer)]
    else:
        samples = encode_records(first, cfg, tokenizer, source)
        shown = [_show(i, ids, labels, cfg, tokenizer) for i, (ids, labels) in enumerate(samples, 1)]
    return source, [asdict(s) | {"text": s.text} for s in shown]


def counts(cfg: DataSection, tokenizer: Any, cache_dir: Path | None, unpaired: bool = False) -> dict[str, Any]:
    """The stats of the whole training data's rows (``rows.build_dataset``), kept in ``cache_dir``."""
    return build_dataset(cfg, tokenizer, cache_dir=cache_dir, unpaired=unpaired)[1]


def _show(index: int, ids: Any, labels: Any, cfg: DataSection, tokenizer: Any) -> Shown:
    """A record's tokens as training keeps them (truncated ones cut at max_length) and what becomes of it."""
    ids, labels = [int(t) for t in ids], [int(t) for t in labels]
    length, limit = len(ids), cfg.max_length
    if length > limit and cfg.too_long != "drop":
        ids, labels = ids[:limit], labels[:limit]
    trained = sum(label != IGNORE_INDEX for label in labels)
    if length > limit and cfg.too_long == "drop":
        fate = f"dropped: longer than max_length {limit}"
    elif not trained:
        fate = "dropped: nothing to train" + (" once truncated" if length > limit else "")
    else:
        fate = f"truncated: {length - limit} tokens cut" if length > limit else "fits"
    return Shown(index, length, trained, fate, _spans(ids, labels, tokenizer))


def _show_pair(index: int, pair: Pair, cfg: DataSection, tokenizer: Any) -> list[Shown]:
    """A preference record as its two rows (prompt + chosen, prompt + rejected), cut as training cuts them."""
    prompt, chosen, rejected = pair
    length, limit = len(prompt) + max(len(chosen), len(rejected)), cfg.max_length
    fate = "fits"
    if length > limit and cfg.too_long == "drop":
        fate = f"dropped: longer than max_length {limit}"
    elif length > limit and len(prompt) >= limit:
        fate = f"stops the run: the prompt alone is {len(prompt)} tokens (data.too_long: drop leaves it out)"
    elif length > limit:
        cut = truncated_pair(prompt, chosen, rejected, limit)
        fate = f"truncated: {len(prompt) - len(cut[0])} prompt tokens cut from the left"
        prompt, chosen, rejected = cut
    shown = []
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
        shown.append(Shown(index, len(ids), len(completion), fate, _spans(ids, labels, tokenizer), side))
    return shown


def _show_unpaired(index: int, row: Row, cfg: DataSection, tokenizer: Any) -> Shown:
    """An unpaired row (KTO) as training cuts it: its side says whether the completion is desirable."""
    prompt, completion, label = row
    (shown,) = _show_pair(index, (prompt, completion, completion), cfg, tokenizer)[:1]
    return Shown(**(asdict(shown) | {"side": "desirable" if label else "undesirable"}))


def _spans(ids: list[int], labels: list[int], tokenizer: Any) -> list[tuple[bool, str]]:
    """The decoded text cut where training starts or stops: each span is the text its tokens add to the
    decoded prefix, so a sentencepiece space or a byte-fallback character lands in the right span."""
    spans: list[tuple[bool, str]] = []
    done, start = "", 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and (labels[end] != IGNORE_INDEX) == (labels[start] != IGNORE_INDEX):
            continue
        text = tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        spans.append((labels[start] != IGNORE_INDEX, text[len(done) :]))
        done, start = text, end
    return spans
