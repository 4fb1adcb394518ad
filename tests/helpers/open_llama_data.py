"""The alpaca records and the tokenizer loader of the Open Llama rehearsal (test_open_llama_data, test_open_llama)."""

from __future__ import annotations

from pathlib import Path

from lowmem_tpu.config import ModelSection
from lowmem_tpu.model import load_tokenizer

ALPACA = [
    {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}
    for word in ("lemon", "paris", "bread", "stone", "river", "cloud", "apple", "tiger")
] + [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep, and move."},
    {"instruction": "Name the capital of France.", "input": "", "output": "Paris is the capital of France."},
]


def tokenizer_of(model_dir: Path, fast: bool = False):
    return load_tokenizer(ModelSection(name_or_path=str(model_dir), use_fast_tokenizer=fast, pad_token="<unk>"))
