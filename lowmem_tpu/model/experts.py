"""A mixture-of-experts layer at static shapes: ``static``, registered with transformers' experts interface.

transformers 5 stores a layer's experts as stacked 3-D parameters (``gate_up_proj`` [experts, 2 x inner,
hidden], ``down_proj`` [experts, hidden, inner]) behind ``@use_experts_implementation``. Its default,
``grouped_mm``, calls ``torch.histc`` on integers and ``torch._grouped_mm``, which torch_xla 2.9 does not
lower; ``eager`` loops over the experts a batch hits (a host sync per layer, a new program per step).

``static`` sorts the batch's (token, expert) pairs by expert at a fixed shape (tokens x top-k rows), runs one
grouped matmul per projection over the sorted rows and puts the rows back. The grouped matmul is the
reference below (every expert over every row, then each row's own: exact, and as costly as a dense layer of
all experts: for tiny models and the CPU backend) or, on a TPU, the kernel ``xla.experts`` provides
(megablox's ``gmm``). Transformers' own ``_apply_gate`` (concatenated or interleaved gate and up), biases and
transposed layouts are honoured, so one implementation serves Qwen 3 MoE, gpt-oss and Gemma 4's experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAME = "static"

# rows [shards, rows, in] (each shard's sorted by expert), weight [E, out, in] (or [E, in, out] when
# transposed), group sizes [shards, E] int32 -> [shards, rows, out]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
_kernel: GroupedMatmul | None = None
_shards = 1


def provide_kernel(kernel: GroupedMatmul | None, shards: int = 1) -> None:
    """The runtime hands over the grouped-matmul kernel (``xla.experts``, on a TPU or in a trace for one) and
    the data-parallel shards the batch's tokens are split into (each shard sorts and multiplies its own)."""
    global _kernel, _shards
    _kernel, _shards = kernel, shards


def reference_grouped_matmul(
    rows: torch.Tensor, weight: torch.Tensor, expert_of_row: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """``rows[..., i, :] @ weight[expert_of_row[..., i]]``, at fixed shapes: every expert over every row, each
    row's kept."""
    every = torch.einsum("...si,eio->...seo" if transposed else "...si,eoi->...seo", rows, weight)
    pick = expert_of_row.unsqueeze(-1).unsqueeze(-1).expand(*expert_of_row.shape, 1, every.shape[-1])
    return every.gather(-2, pick).squeeze(-2)


def _project(
    module: Any, name: str, rows: torch.Tensor, expert_of_row: torch.Tensor, group_sizes: torch.Tensor
) -> torch.Tensor:
    weight = getattr(module, name)
    transposed = bool(getattr(module, "is_transposed", False))
    if _kernel is not None:
        out = _kernel(rows, weight, group_sizes, transposed)
    else:
        out = reference_grouped_matmul(rows, weight, expert_of_row, transposed)
    if getattr(module, "has_bias", False):
        out = out + getattr(module, f"{name}_bias")[expert_of_row]
    return out


def _along_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[s, index[s, i]]`` for [shards, n, width] values and [shards, m] indices."""
    return values.gather(1, index.unsqueeze(-1).expand(*index.shape, values.shape[-1]))


def static_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (``[tokens, hidden]``, the router's top-k experts and weights), static.

    The tokens split into ``shards`` contiguous blocks (one per device holding them); each sorts its
    (token, expert) pairs by expert, so a shard's rows and group sizes stay its own."""
    tokens, top_k = top_k_index.shape
    shards = _shards if tokens % _shards == 0 else 1
    chosen = top_k_index.reshape(shards, -1)  # [shards, rows]
    order = torch.argsort(chosen, dim=1, stable=True)  # rows grouped by expert, each group in token order
    expert_of_row = chosen.gather(1, order)
    hidden = hidden_states.reshape(shards, tokens // shards, -1)
    rows = _along_rows(hidden, torch.div(order, top_k, rounding_mode="floor"))
    group_sizes = torch.zeros(shards, self.num_experts, dtype=torch.int32, device=chosen.device)
    group_sizes = group_sizes.scatter_add(1, chosen, torch.ones_like(chosen, dtype=torch.int32))
    if getattr(self, "has_gate", True):
        inner = self._apply_gate(_project(self, "gate_up_proj", rows, expert_of_row, group_sizes))
    else:
        inner = self.act_fn(_project(self, "up_proj", rows, expert_of_row, group_sizes))
    out = _project(self, "down_proj", inner, expert_of_row, group_sizes)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(shards, -1).gather(1, order).unsqueeze(-1).to(out.dtype)
    places = torch.arange(order.shape[1], device=order.device).expand_as(order)
    back = _along_rows(out, torch.zeros_like(order).scatter(1, order, places))  # rows to their (token, slot)
    return back.reshape(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Make ``static`` known to transformers before a model with experts is built (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, static_experts_forward)


def without_router_logits(model: Any) -> dict[str, Any]:
    """Forward arguments for scoring or sampling a MoE model: no router logits, so no auxiliary loss (TRL turns
    them on in the config for training; transformers' loss on them counts experts with ``histc``, which XLA
    runs on the CPU and fails on, when no attention mask is given)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"output_router_logits": False} if hasattr(text, "output_router_logits") else {}
