"""How full the rows are: the share of a row's positions that hold real tokens, not padding.

A step's cost is per position; what training gains is per real token. Alpaca-style records at
``max_length: 1024`` fill about half of each padded row, packed rows far more. Measured on the
recipe's own data (its first records, tokenized as training tokenizes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem_tpu.config import DataSection, with_fields

SAMPLES = 2000  # records read (the first ones): enough for a share, quick to tokenize


@dataclass(frozen=True)
class Fill:
    """Real tokens over row positions, with and without packing, or why they could not be measured."""

    padded: float | None
    packed: float | None
    samples: int = 0
    why: str = ""

    def of(self, packing: bool) -> float | None:
        return self.packed if packing else self.padded


def measure_fill(cfg: DataSection, tokenizer: Any, samples: int = SAMPLES) -> Fill:
    """The fill of the training data, padded and packed (its first ``samples`` records)."""
    from lowmem_tpu.data.rows import build_dataset

    shares, read = {True: None}, 0
    per_record = 2 if cfg.format == "preference" else 1  # a preference pair is two rows, never packed
    for packing in (False, True) if per_record == 1 else (False,):
        data = with_fields(cfg, packing=packing)
        _, stats = build_dataset(data, tokenizer, max_samples=samples)
        positions = stats["rows"] * per_record * data.max_length
        shares[packing] = stats["tokens"] / positions if positions else None
        read = stats["samples"]
    return Fill(shares[False], shares[True], read)
