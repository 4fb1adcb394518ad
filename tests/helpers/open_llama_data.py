"""The alpaca records and the tokenizer loader of the Open Llama rehearsal (test_open_llama_data, test_open_llama).

python tests/helpers/open_llama_data.py FILE   # the records eight times over as a JSON array (what
                                               # benchmarks/rehearse_open_llama.py trains on)
"""

from __future__ import annotations

import json
import sys
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


def write_alpaca(path: Path) -> Path:
    """``ALPACA`` eight times over as a JSON array, as alpaca-cleaned ships."""
    path.write_text(json.dumps(ALPACA * 8, indent=1))
    return path


def tokenizer_of(model_dir: Path, fast: bool = False):
    return load_tokenizer(ModelSection(name_or_path=str(model_dir), use_fast_tokenizer=fast, pad_token="<unk>"))


if __name__ == "__main__":
    write_alpaca(Path(sys.argv[1]))
