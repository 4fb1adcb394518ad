"""``model.attn_implementation: flash``: torch_xla's Pallas FlashAttention kernel, TPU only.

Written against torch_xla 2.9's ``experimental/custom_kernel.py``: ``flash_attention(q, k, v,
causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec=, mesh=)`` on [batch, heads,
length, head] tensors, with the SPMD partition spec splitting the batch over the ``fsdp`` axis.
Packed rows pass their ``segment_ids`` as the kernel's q/kv segment ids (float32, split over
the batch like q, as pytorch/xla's test/test_pallas_spmd.py does in
test_flash_attention_spmd_data_parallel_with_segment_ids), so a token sees only its own sample.
Unpacked rows pass none: they are right-padded and the mask is causal, so no real token ever sees
a padding key (padding queries produce values the loss masks out). Left padding (generation) is
not supported: generation uses sdpa. A model's sliding window is taken only where it cannot bind
(rows no longer than the window: ``config.features.Attention``), a soft-cap never. A head size that
is not a multiple of 128 lanes (Open Llama's is 100) is zero-padded to the next multiple and sliced
back (q.k and the output are unchanged), at that compute cost.
On the CPU backend the kernel cannot run ("Only interpret mode is supported on CPU backend"): a run
there computes the same attention with ``chunked`` (``preflight.as_run_here``) and says so.
"""

from __future__ import annotations

from typing import Any

import torch

from lowmem_tpu.config.devices import LANES


def flash_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    window, length = kwargs.get("sliding_window"), query.shape[2]
    if kwargs.get("softcap") or (window is not None and window < length):  # validate refuses such recipes
        raise RuntimeError(f"flash attention has no soft-cap and no window ({window} keys, rows of {length})")
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.custom_kernel import flash_attention

    from lowmem_tpu.model.attention import heads_for_every_query

    key, value, scale = heads_for_every_query(query, key, value, scaling)
    head = query.shape[-1]
    pad = -head % LANES
    if pad:
        query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
    segments = kwargs.get("segment_ids")
    segments = None if segments is None else segments.to(torch.float32)
    out = flash_attention(
        query,
        key,
        value,
        causal=True,
        q_segment_ids=segments,
        kv_segment_ids=segments,
        sm_scale=scale,
        partition_spec=("fsdp", None, None, None),
        mesh=xs.get_global_mesh(),
    )
    return out[..., :head].transpose(1, 2).contiguous(), None


def install() -> None:
    """Give ``model.attention`` the TPU kernel behind the name ``flash``."""
    from lowmem_tpu.model.attention import provide_flash

    provide_flash(flash_attention_forward)
