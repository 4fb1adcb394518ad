"""Tokenized rows kept on disk, so a resume or a rerun does not tokenize again.

A cache entry is ``DIR/KEY/rows.npz`` (int32 ``input_ids``, ``attention_mask``, ``labels``) and
``stats.json``. The key hashes everything the rows depend on: the records (``datasets``'
fingerprint of the loaded files or Hub revision), the tokenizer (class, vocabulary, special
tokens, chat template) and every data setting. An entry is written beside its final name and
renamed into place, so a crash leaves none half-written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_tpu import faults
from lowmem_tpu.files import fresh_partial, publish, write_json

if TYPE_CHECKING:
    import numpy as np

VERSION = 5  # bump when the rows a setting produces change
ROWS, STATS = "rows.npz", "stats.json"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What the token ids depend on: the tokenizer's class, vocabulary, special tokens and template."""
    parts = {
        "class": type(tokenizer).__name__,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
        "template": getattr(tokenizer, "chat_template", None),
        "add_bos": getattr(tokenizer, "add_bos_token", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(records_fingerprint: str, tokenizer: Any, settings: dict[str, Any]) -> str:
    """The entry name for rows made from these records, by this tokenizer, with these settings."""
    payload = {
        "version": VERSION,
        "records": records_fingerprint,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(directory: Path | None, key: str) -> tuple[dict[str, np.ndarray], dict[str, int]] | None:
    """The cached arrays and stats, or None when there is no complete entry."""
    if directory is None or not (directory / key / STATS).is_file():
        return None
    import numpy as np

    with np.load(directory / key / ROWS) as rows:
        arrays = {name: rows[name] for name in rows.files}
    return arrays, json.loads((directory / key / STATS).read_text())


def save(directory: Path | None, key: str, arrays: dict[str, np.ndarray], stats: dict[str, int]) -> None:
    """Write one entry (the stats last: an entry without them is never read)."""
    if directory is None:
        return
    import numpy as np

    final = directory / key
    partial = fresh_partial(final)
    np.savez(partial / ROWS, **arrays)
    write_json(partial / STATS, stats)
    faults.point("cache")
    publish(partial, final)
