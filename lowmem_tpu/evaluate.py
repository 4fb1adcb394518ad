"""Greedy exact-match evaluation with static shapes (one compiled graph for every token).

Prompts are right-padded into a fixed ``[batch, length]`` buffer; each step runs the
full buffer, reads the logits at every row's current end and writes the argmax one
position further. Causal attention means the padding after a row's end never
influences it, so no attention mask and no shape ever changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lowmem_tpu.data.chat import Ending


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
            ids = _decode_batch(model, tokenizer, chunk, length, max_new_tokens, batch_size, device, sync)
            completions += [ending.clean(tokenizer.decode(ending.cut(row), skip_special_tokens=True)) for row in ids]
    finally:
        model.train(was_training)
    correct = [c.strip() == answer.strip() for c, (_, answer) in zip(completions, prompts, strict=True)]
    examples = [
        (tokenizer.decode(ids, skip_special_tokens=False), answer, completion)
        for (ids, answer), completion in list(zip(prompts, completions, strict=True))[:3]
    ]
    total = len(prompts)
    return ExactMatch(sum(correct) / max(total, 1), sum(correct), total, examples)


def _decode_batch(model, tokenizer, chunk, length, max_new_tokens, batch_size, device, sync) -> list[list[int]]:
    pad = tokenizer.pad_token_id
    # A prompt too long for the buffer loses its beginning, never its end (the generation prompt).
    rows = [ids[-(length - max_new_tokens) :] for ids, _ in chunk]
    rows += [rows[0]] * (batch_size - len(rows))  # a full batch keeps the shape static
    buffer = torch.full((batch_size, length), pad, dtype=torch.long)
    for i, ids in enumerate(rows):
        buffer[i, : len(ids)] = torch.tensor(ids)
    ends = torch.tensor([len(ids) - 1 for ids in rows])
    tokens, ends = buffer.to(device), ends.to(device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=tokens, use_cache=False).logits
            last = logits.gather(1, ends.view(-1, 1, 1).expand(-1, 1, logits.size(-1))).squeeze(1)
            ends = ends + 1
            tokens = tokens.scatter(1, ends.view(-1, 1), last.argmax(-1).view(-1, 1))
            sync()
    host, host_ends = tokens.cpu(), ends.cpu()
    return [host[i, len(ids) : int(host_ends[i]) + 1].tolist() for i, ids in enumerate(rows[: len(chunk)])]
