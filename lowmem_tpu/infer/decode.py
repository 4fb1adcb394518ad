"""Decoding with static shapes, two ways: a KV cache for one prompt, or a full buffer for a batch of them.

``Decoder`` (``generate``, ``chat``): the prompt is left-padded to a multiple of ``bucket`` tokens and run once (the
prefill) into a ``StaticCache`` of ``bucket + max_new_tokens`` positions; every later step feeds one token at the
next cache position with the same full-length attention mask. Shapes never change within a bucket, so XLA compiles
two graphs per bucket (prefill, step) and reuses them for every prompt that falls in it. Greedy picks the argmax on
the device (one integer comes back per step); sampling brings the last logits to the host and draws there with a
seeded generator, so a seed gives the same text on the XLA devices and on plain CPU PyTorch.

``greedy_rows`` (exact match, in ``sft`` and ``eval``): prompts are right-padded into a fixed ``[batch, length]``
buffer; each step runs the whole buffer without a cache, reads the logits at every row's current end and writes
the argmax one position further. Causal attention means the padding after a row's end never influences it, so
no attention mask and no shape ever changes: one compiled graph for every token, and the training model works
as it is, whatever its layout (FSDP-wrapped and checkpointed layers, scanned layers, flash attention), which a
cache would not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lowmem_tpu.errors import UserError
from lowmem_tpu.model.experts import without_router_logits


@dataclass(frozen=True)
class Generation:
    """One completion: its token ids (no EOS), why it stopped, and how long decoding took."""

    ids: list[int]
    prompt_tokens: int
    stopped: str  # "eos" or "length"
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0


def bucket_length(prompt: int, max_new_tokens: int, positions: int, bucket: int) -> int:
    """The padded prompt length: ``prompt`` rounded up to a multiple of ``bucket``, within the model's positions."""
    if prompt + max_new_tokens > positions:
        raise UserError(
            f"the prompt is {prompt} tokens; with --max-new-tokens {max_new_tokens} it needs "
            f"{prompt + max_new_tokens} positions, and the model has {positions}: shorten the prompt "
            "or lower --max-new-tokens"
        )
    return min(math.ceil(prompt / bucket) * bucket, positions - max_new_tokens)


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The next token from one row of logits on the host: greedy at temperature 0, else top-p sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest set reaching top_p (at least one)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass
class Decoder:
    """Generates from ``model`` on ``device``; ``sync`` cuts the XLA graph after each step (a no-op on the CPU)."""

    model: Any
    device: torch.device
    sync: Callable[[], None]
    eos_ids: tuple[int, ...]
    pad_id: int
    positions: int
    bucket: int = 64

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Generation:
        from transformers import StaticCache

        started = time.perf_counter()
        length = bucket_length(len(prompt), max_new_tokens, self.positions, self.bucket)
        pad = length - len(prompt)
        total = length + max_new_tokens
        mask = torch.zeros(1, total, dtype=torch.long)
        mask[0, pad:] = 1  # the padding before the prompt is never attended; the future is masked causally
        mask = mask.to(self.device)
        cache = StaticCache(config=self.model.config, max_cache_len=total)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([[self.pad_id] * pad + prompt])
        positions = (torch.arange(length) - pad).clamp(min=0).view(1, -1)
        step = {"input_ids": ids, "position_ids": positions, "cache_position": torch.arange(length)}
        out: list[int] = []
        stopped = "length"
        quiet = without_router_logits(self.model)
        with torch.no_grad():
            for t in range(max_new_tokens):
                inputs = {k: v.to(self.device) for k, v in step.items()}
                logits = self.model(**inputs, attention_mask=mask, cache=cache, use_cache=True, **quiet).logits[0, -1]
                chosen = logits.argmax(-1) if temperature <= 0 else logits.float()
                self.sync()
                token = int(chosen.cpu()) if temperature <= 0 else pick(chosen.cpu(), temperature, top_p, generator)
                if token in self.eos_ids:
                    stopped = "eos"
                    break
                out.append(token)
                step = {
                    "input_ids": torch.tensor([[token]]),
                    "position_ids": torch.tensor([[len(prompt) + t]]),
                    "cache_position": torch.tensor([length + t]),
                }
        return Generation(out, len(prompt), stopped, time.perf_counter() - started)


def greedy_rows(
    model: Any,
    prompts: list[list[int]],
    pad: int,
    length: int,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device,
    sync: Callable[[], None],
) -> list[list[int]]:
    """Greedy completions of up to ``batch_size`` prompts in one ``[batch_size, length]`` buffer (no cache)."""
    # A prompt too long for the buffer loses its beginning, never its end (the generation prompt).
    rows = [ids[-(length - max_new_tokens) :] for ids in prompts]
    rows += [rows[0]] * (batch_size - len(rows))  # a full batch keeps the shape static
    buffer = torch.full((batch_size, length), pad, dtype=torch.long)
    for i, ids in enumerate(rows):
        buffer[i, : len(ids)] = torch.tensor(ids)
    ends = torch.tensor([len(ids) - 1 for ids in rows])
    tokens, ends = buffer.to(device), ends.to(device)
    quiet = without_router_logits(model)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=tokens, use_cache=False, **quiet).logits
            last = logits.gather(1, ends.view(-1, 1, 1).expand(-1, 1, logits.size(-1))).squeeze(1)
            ends = ends + 1
            tokens = tokens.scatter(1, ends.view(-1, 1), last.argmax(-1).view(-1, 1))
            sync()
    host, host_ends = tokens.cpu(), ends.cpu()
    return [host[i, len(ids) : int(host_ends[i]) + 1].tolist() for i, ids in enumerate(rows[: len(prompts)])]
