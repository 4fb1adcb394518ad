"""``model.attn_implementation: chunked``: attention over blocks of keys with an online softmax.

Eager and sdpa attention materialize the [batch, heads, length, length] scores in fp32 and keep
them for the backward pass. Here the forward pass walks the keys in blocks of ``BLOCK``, keeping a
running maximum and sum per query (FlashAttention's online softmax), and saves only the output and
each row's log-sum-exp; the backward pass recomputes each block's probabilities from them. No
[length, length] tensor exists, only [length, BLOCK] ones, one block at a time. Plain PyTorch: XLA
compiles it on every backend (the CPU-tested path; ``flash`` is the TPU kernel).

Causal masking and padding come from positions and the 2-D padding mask (transformers hands this
implementation the [batch, length] mask as it does flash attention), or, for packed rows, the
``segment_ids`` the trainer passes along: a key is visible only within its query's sample. No mask
of [length, length] is built either. Any head size works (Open Llama's is 100).

What a model defines beyond that comes as the attention call's keyword arguments, as transformers'
layers pass them to every implementation: ``sliding_window`` (Gemma 2/3's local layers, Mistral,
Phi-3: a query sees its last ``window`` keys, itself included, as transformers' sliding-window mask
has it) and ``softcap`` (Gemma 2: scores become ``tanh(s / cap) * cap`` before the softmax, as in
its eager attention). Both are applied block by block, forward and backward. gpt-oss's attention sinks
(``module.sinks``: a learned score per head that joins every row's softmax and carries no value) enter each
row's sum once, after the last block, and get their own gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from lowmem_tpu.model.ordering import after

BLOCK = 128
NAME = "chunked"


def _allowed(
    q_len: int, start: int, stop: int, k_len: int, padding: torch.Tensor | None, window: int | None, device: Any
) -> torch.Tensor:
    """[batch or 1, 1, q, block] bool: a key is visible when it is not in the future, not padding, within
    the ``window`` last keys (if any), and (``padding`` holding segment ids: packed rows) in the query's own sample."""
    q_pos = torch.arange(q_len, device=device) + (k_len - q_len)
    k_pos = torch.arange(start, stop, device=device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    allowed = visible[None, None]
    if padding is not None:
        keys = padding[:, None, None, start:stop]
        allowed = allowed & (keys != 0) & (padding[:, None, k_len - q_len :, None] == keys)
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    return s.masked_fill(~allowed, float("-inf"))


class ChunkedAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal, padded, windowed, soft-capped) v, block by block; saves out and
    log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any, q, k, v, padding, scale: float, block: int, window: int | None, cap: float | None, sinks=None
    ):  # type: ignore[override]
        q_len, k_len = q.shape[2], k.shape[2]
        row_max = torch.full((*q.shape[:3], 1), float("-inf"), device=q.device)
        row_sum = torch.zeros((*q.shape[:3], 1), device=q.device)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for start in range(0, k_len, block):
            stop = min(start + block, k_len)
            allowed = _allowed(q_len, start, stop, k_len, padding, window, q.device)
            s = _scores(q, k[:, :, start:stop], allowed, scale, cap)
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - safe)
            correction = torch.exp(row_max - safe)
            row_sum = row_sum * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + torch.matmul(p, v[:, :, start:stop].float())
            row_max = new_max
        if sinks is not None:  # exp(sink) joins each row's sum: as a last block of one key with no value
            sink = sinks.float().reshape(1, -1, 1, 1)
            new_max = torch.maximum(row_max, sink)
            row_sum = row_sum * torch.exp(row_max - new_max) + torch.exp(sink - new_max)
            acc, row_max = acc * torch.exp(row_max - new_max), new_max
        out = acc / row_sum.clamp(min=1e-30)  # a row that sees nothing (left padding) gives 0, not NaN
        lse = torch.where(row_sum > 0, torch.log(row_sum.clamp(min=1e-30)) + row_max, torch.zeros_like(row_sum))
        saved = (padding if padding is not None else torch.empty(0), sinks if sinks is not None else torch.empty(0))
        ctx.save_for_backward(q, k, v, *saved, out, lse)
        ctx.scale, ctx.block, ctx.has_padding, ctx.has_sinks = scale, block, padding is not None, sinks is not None
        ctx.window, ctx.cap = window, cap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, padding, sinks, out, lse = ctx.saved_tensors
        padding = padding if ctx.has_padding else None
        scale, block, window, cap = ctx.scale, ctx.block, ctx.window, ctx.cap
        q_len, k_len = q.shape[2], k.shape[2]
        d_out = grad_out.float()
        delta = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dks, dvs = [], []
        for start in range(0, k_len, block):
            stop = min(start + block, k_len)
            # The blocks' gradients are independent but for dq: unordered, XLA computes them all at once
            # (model.ordering; the TPU compiler, Open Llama 3B's width at 4 layers, v5e-8: 2.99 GiB per
            # chip unordered, 2.27 ordered, 1.73 with eager attention, which still keeps less).
            k_blk = after(k[:, :, start:stop], dvs[-1].sum() if dvs else None).float()
            v_blk = v[:, :, start:stop].float()
            # (q * scale) k^T, not (q k^T) * scale as in the forward pass: a different expression, so
            # XLA cannot merge it with the forward's scores and keep those alive until here.
            allowed = _allowed(q_len, start, stop, k_len, padding, window, q.device)
            s = torch.matmul(q.float() * scale, k_blk.transpose(-1, -2))
            if cap is not None:
                capped = torch.tanh(s / cap)
                s = capped * cap
            p = torch.exp(s.masked_fill(~allowed, float("-inf")) - lse)
            dvs.append(torch.matmul(p.transpose(-1, -2), d_out))
            ds = p * (torch.matmul(d_out, v_blk.transpose(-1, -2)) - delta)
            if cap is not None:
                ds = ds * (1 - capped * capped)  # d tanh: the cap's own derivative, before the mask
            dq = dq + torch.matmul(ds, k_blk) * scale
            dks.append(torch.matmul(ds.transpose(-1, -2), q.float()) * scale)
        dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)
        d_sinks = None
        if ctx.has_sinks:  # a sink's probability times (its value's score, 0, minus the row's mean)
            p_sink = torch.exp(sinks.float().reshape(1, -1, 1, 1) - lse)
            d_sinks = (-p_sink * delta).sum((0, 2, 3)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, d_sinks


def heads_for_every_query(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Keys and values repeated for grouped-query attention (each serves ``groups`` query heads), and the scale."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return key, value, scaling if scaling is not None else query.shape[-1] ** -0.5


def chunked_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: [batch, heads, length, head] in, [batch, length, heads, head] out."""
    key, value, scale = heads_for_every_query(query, key, value, scaling)
    segments = kwargs.get("segment_ids")
    if segments is None and attention_mask is not None and attention_mask.dim() == 2:
        segments = attention_mask.long()  # one sample per row: 1 on tokens, 0 on padding
    window, cap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), getattr(module, "sinks", None)
    out = ChunkedAttention.apply(query, key, value, segments, scale, BLOCK, window, cap, sinks)
    return out.transpose(1, 2).contiguous(), None


def padding_mask(*args: Any, attention_mask: torch.Tensor | None = None, kv_length: int = 0, **kwargs: Any) -> Any:
    """The [batch, keys] mask as it came (transformers' flash variant asks ``mask.all()`` first: a host
    sync per forward on XLA)."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def keep_kv_shared_inputs_whole(model: Any) -> None:
    """Gemma 4 cuts its inputs to the last ``logits_to_keep`` positions before the layers that reuse earlier
    layers' K/V (``_maybe_slice_kv_shared_inputs``), indexing each mask as ``[batch, 1, queries, keys]``: the
    ``[batch, keys]`` mask chunked and flash take (``padding_mask``) raises an IndexError there. Training keeps
    every position (``logits_to_keep`` 0) and so does this model: the cut is skipped."""
    for module in model.modules():
        if hasattr(type(module), "_maybe_slice_kv_shared_inputs"):
            module._maybe_slice_kv_shared_inputs = _whole


def _whole(hidden: Any, per_layer: Any, positions: Any, masks: Any, *args: Any, **kwargs: Any) -> tuple:
    return hidden, per_layer, positions, masks


def packed_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, length, length] additive mask for eager/sdpa on packed rows: causal, within a sample.

    A padding query (segment 0) sees nothing: its row is all the dtype's minimum (softmax stays finite).
    """
    length = segments.shape[1]
    positions = torch.arange(length, device=segments.device)
    causal = positions[None, :] <= positions[:, None]
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] != 0)
    allowed = (causal[None] & same)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_inputs(inputs: dict[str, Any], implementation: str, dtype: torch.dtype) -> dict[str, Any]:
    """Model inputs of a packed batch: segment ids for chunked/flash, a [length, length] mask for eager/sdpa."""
    if "segment_ids" not in inputs:
        return inputs
    if implementation in (NAME, "flash"):
        return inputs
    rest = {k: v for k, v in inputs.items() if k != "segment_ids"}
    return rest | {"attention_mask": packed_mask(inputs["segment_ids"], dtype)}


_flash_kernel: Any = None


def provide_flash(kernel: Any) -> None:
    """The runtime (``xla.flash``, on a TPU) hands over the kernel behind ``flash``."""
    global _flash_kernel
    _flash_kernel = kernel


def _flash(*args: Any, **kwargs: Any) -> Any:
    if _flash_kernel is None:
        raise RuntimeError("model.attn_implementation flash runs on a TPU only; use chunked elsewhere")
    return _flash_kernel(*args, **kwargs)


# The name transformers knows ``flash`` by: transformers 5 takes any name with "flash" in it for the
# CUDA flash-attn package or a Hub kernel (utils/generic.py's is_flash_attention_requested), fails to
# import one ("Could not find the currently requested flash attention implementation") and builds no model.
FLASH_NAME = "tpu_pallas"


def transformers_name(name: str) -> str:
    """The ``attn_implementation`` transformers is given for ``model.attn_implementation: name``."""
    return FLASH_NAME if name == "flash" else name


def register(name: str) -> None:
    """Make ``chunked`` or ``flash`` known to transformers before a model is built with it (idempotent)."""
    if name not in (NAME, "flash"):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(transformers_name(name), chunked_attention_forward if name == NAME else _flash)
    AttentionMaskInterface.register(transformers_name(name), padding_mask)
