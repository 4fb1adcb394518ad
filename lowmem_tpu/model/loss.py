"""``train.chunked_loss``: next-token cross-entropy over blocks of positions, never the whole logits.

The model's own head builds [batch, length, vocab] logits, the loss upcasts them to fp32 and the
backward pass keeps their gradient: three fp32 copies of [tokens, vocab] (Open Llama's vocabulary
is 32000 wide: 0.5 GiB per 4096 tokens each). Here the head runs over one block of positions at
a time (at most 256, at least 8 blocks: ``config.rules.loss_block``): the forward pass keeps
only each position's loss terms, the backward pass recomputes one block's logits, turns them
into the gradient and drops them. Blocks run along the sequence, so each keeps the batch's
sharding over the devices (no resharding under SPMD).

TRL's fused head (``train.fused_lm_head``) does the same over flattened rows, which on XLA costs
a resharding per tile and about doubles the step time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lowmem_tpu.config.rules import loss_block
from lowmem_tpu.model.ordering import after

IGNORE = -100


def _blocks(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels`` (IGNORE skipped), and the top-1 hits.

    hidden [batch, length, hidden], weight [vocab, hidden], labels [batch, length] (already shifted).
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, labels, chunk: int):  # type: ignore[override]
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = hidden.new_zeros((), dtype=torch.float32)
        for start, stop in _blocks(hidden.shape[1], chunk):
            y = labels[:, start:stop]
            h = after(hidden[:, start:stop], total + correct if start else None)
            logits = torch.matmul(h, weight.t()).float()  # [batch, block, vocab]
            keep = y != IGNORE
            target = logits.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            total = total + ((torch.logsumexp(logits, -1) - target) * keep).sum()
            # A hit: the label's logit is the largest (a tie counts). Not argmax: over logits split along
            # the vocabulary (the head is FSDP-sharded on it) its index reduction is resharded with an
            # int32 [batch, block, vocab] iota per block, which the TPU compiler kept for every block
            # (mini, v5e-8: 346 MiB against 185 without the chunked loss). A max is reduced in place.
            correct = correct + ((target >= logits.amax(-1)) & keep).sum()
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_correct: Any):  # type: ignore[override]
        hidden, weight, labels = ctx.saved_tensors
        want_weight = ctx.needs_input_grad[1]
        grad_hidden = []
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start, stop in _blocks(hidden.shape[1], ctx.chunk):
            h, y = hidden[:, start:stop], labels[:, start:stop]
            h = after(h, grad_hidden[-1].sum() if grad_hidden else None)
            keep = (y != IGNORE).unsqueeze(-1)
            # (2h) @ weight^T / 2 (exact: a power of two): another expression than the forward's
            # h @ weight^T, so XLA cannot merge the two and keep every block's forward logits alive
            # until here (measured on the CPU compiler: all 8 blocks' were, with the same expression).
            logits = torch.matmul(h * 2, weight.t()).float() * 0.5
            probs = torch.softmax(logits, dim=-1)
            scale = keep * grad_total  # d(sum of losses) = softmax - one-hot, at kept positions
            rows = weight[y.clamp(min=0)].float()  # the label's row of the head: the one-hot's share
            # In the head's dtype (a bf16 matmul accumulates in fp32): weight.float() would be an fp32
            # copy of the whole gathered head (0.4 GB for Open Llama 3B), which the plan does not hold.
            spread = torch.matmul((probs * scale).to(weight.dtype), weight).float()
            grad_hidden.append((spread - rows * scale).to(hidden.dtype))
            if want_weight:
                flat_h, flat_y = h.reshape(-1, h.shape[-1]).float(), y.reshape(-1).clamp(min=0)
                flat_scale = scale.reshape(-1, 1)
                grad_weight = grad_weight + torch.matmul((probs * scale).reshape(-1, probs.shape[-1]).t(), flat_h)
                grad_weight = grad_weight.index_add(0, flat_y, -(flat_h * flat_scale))
        grad_w = grad_weight.to(weight.dtype) if want_weight else None
        return torch.cat(grad_hidden, dim=1), grad_w, None, None


def summed_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token loss, top-1 hits) of the unshifted ``labels`` for ``hidden`` [batch, length, hidden],
    over blocks of ``chunk`` positions (default: ``config.rules.loss_block``)."""
    chunk = chunk or loss_block(hidden.shape[1])
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    return ChunkedCrossEntropy.apply(hidden, weight, shifted, chunk)


def add_chunked_loss(causal_lm: Any) -> None:
    """Let ``causal_lm(..., labels=, chunked_loss=True)`` return ``{"loss": summed, "correct": hits}``, no logits.

    Wraps the instance's ``forward`` (TRL's, when TRL patched it), as TRL adds its fused head: PEFT
    and the FSDP wrappers call through to it. Other calls are unchanged.
    """
    from lowmem_tpu.config.features import chunked_loss_refusal
    from lowmem_tpu.errors import UserError

    refusal = chunked_loss_refusal(causal_lm.config)
    if refusal:
        raise UserError(refusal)
    original = causal_lm.forward

    @functools.wraps(original)
    def forward(*args: Any, chunked_loss: bool = False, labels: Any = None, **kwargs: Any) -> Any:
        if not chunked_loss:
            return original(*args, labels=labels, **kwargs)
        kwargs.pop("num_items_in_batch", None)
        hidden = causal_lm.base_model(*args, **kwargs).last_hidden_state
        total, correct = summed_loss(hidden, causal_lm.get_output_embeddings().weight, labels)
        return {"loss": total, "correct": correct}

    causal_lm.forward = forward
