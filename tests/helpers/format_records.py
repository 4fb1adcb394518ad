"""The records of each data format people bring (test_formats, test_format_training)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_COMPLETION = [
    {"prompt": f"Reverse the word {word}.\nAnswer:", "completion": f" {word[::-1]}"}
    for word in ("lemon", "paris", "bread", "stone")
]
CONVERSATIONAL = [
    {
        "prompt": [
            {"role": "system", "content": "You reverse words."},
            {"role": "user", "content": f"Reverse {word}."},
        ],
        "completion": [{"role": "assistant", "content": word[::-1]}],
    }
    for word in ("lemon", "paris", "bread", "stone")
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "You reverse words."},
            {"from": "human", "value": f"Reverse {word}."},
            {"from": "gpt", "value": word[::-1]},
            {"from": "human", "value": "And again?"},
            {"from": "gpt", "value": word},
        ]
    }
    for word in ("lemon", "paris", "bread", "stone")
]
DOLLY = [  # databricks-dolly-15k's columns
    {"instruction": "Reverse the word.", "context": word, "response": word[::-1], "category": "open_qa"}
    for word in ("lemon", "paris", "bread", "stone")
]
DOLLY_COLUMNS = {"instruction": "instruction", "input": "context", "output": "response"}


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
