"""Greedy exact match: held-out prompts decoded by ``decode.greedy_rows`` and scored against their answers.

What ``sft`` prints before and after training and ``eval`` prints for any data: the share of prompts whose
greedy completion, cut where a reply ends, equals the expected answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lowmem_tpu.data.chat import Ending, reply_text
from lowmem_tpu.infer.decode import greedy_rows


@dataclass(frozen=True)
class ExactMatch:
    accuracy: float
    correct: int
    total: int
    examples: list[tuple[str, str, str]]  # (prompt, expected, generated), the first few


def greedy_exact_match(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[tuple[list[int], str]],
    *,
    ending: Ending,
    length: int,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device,
    sync: Any,
) -> ExactMatch:
    """Score ``(prompt_ids, answer)`` pairs by greedy decoding; ``sync`` cuts one XLA step."""
    was_training = model.training
    model.eval()
    completions: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            rows = [ids for ids, _ in chunk]
            ids = greedy_rows(model, rows, tokenizer.pad_token_id, length, max_new_tokens, batch_size, device, sync)
            completions += [ending.clean(reply_text(tokenizer, ending.cut(row))) for row in ids]
    finally:
        model.train(was_training)
    correct = [c.strip() == answer.strip() for c, (_, answer) in zip(completions, prompts, strict=True)]
    examples = [
        (tokenizer.decode(ids, skip_special_tokens=False), answer, completion)
        for (ids, answer), completion in list(zip(prompts, completions, strict=True))[:3]
    ]
    total = len(prompts)
    return ExactMatch(sum(correct) / max(total, 1), sum(correct), total, examples)
