"""The grouped matmul behind ``static`` experts on a TPU: megablox's ``gmm`` and ``tgmm``, one shard per device.

Written against torch_xla 2.9's ``experimental/custom_kernel.py``: ``gmm(lhs [m, k], rhs [groups, k, n] (or
[groups, n, k] with ``transpose_rhs``), group_sizes [groups] int32, tiling)`` and ``tgmm(lhs [k, m], rhs [m, n],
group_sizes, tiling) -> [groups, k, n]``, Pallas kernels traced through jax (``call_jax``). Like that file's
flash attention (``_shard_map``, ``FlashAttention.forward``/``backward``), each kernel runs under manual
sharding: a device multiplies its own sorted rows ([shards, rows, in], split over the ``fsdp`` axis, with its
own group sizes) by the whole expert stack (gathered as FSDP gathers any weight). The backward computes the
rows' gradient with ``gmm`` and the stack's with ``tgmm`` only when the stack needs one (full fine-tuning, or
PEFT's LoRA folded into it); each device's share of the stack's gradient is summed across devices outside
the manual region, where SPMD places the collective.

On the CPU backend the kernels cannot run ("Only interpret mode is supported on CPU backend"): runs there
use the reference in ``model.experts``; ``local`` swaps in a plain-torch kernel of the same contract, which
the tests use to check this file's sharding and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lowmem_tpu.config.devices import LANES
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.ordering import after


def _tile(size: int, cap: int) -> int:
    """The largest multiple of 128 up to ``cap`` that divides ``size`` (the kernels' tiles must), else ``size``."""
    return next((t for t in range(min(cap, size) // LANES * LANES, 0, -LANES) if size % t == 0), size)


def tpu_gmm(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
    from torch_xla.experimental.custom_kernel import gmm

    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = (_tile(lhs.shape[0], 512), _tile(lhs.shape[1], 2048), _tile(n, 2048))
    return gmm(lhs, rhs, sizes, tiling, transpose_rhs=transpose_rhs)


def tpu_tgmm(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    from torch_xla.experimental.custom_kernel import tgmm

    tiling = (_tile(lhs.shape[1], 512), _tile(lhs.shape[0], 512), _tile(rhs.shape[1], 512))
    return tgmm(lhs, rhs, sizes, tiling)


def _count(like: torch.Tensor, n: int) -> torch.Tensor:
    """0 .. n-1, made from ``like`` (a manual region takes no fresh device tensor, nor searchsorted)."""
    return torch.ones_like(like[:1]).expand(n).cumsum(0) - 1


def _expert_of_row(sizes: torch.Tensor, rows: int) -> torch.Tensor:
    ends = torch.cumsum(sizes, 0)
    return (_count(sizes, rows)[:, None] >= ends[None, :]).sum(1)


def local_gmm(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
    """``gmm``'s contract in plain torch (every group over every row, each row's kept): for tests on the CPU."""
    every = torch.einsum("mk,gnk->mgn" if transpose_rhs else "mk,gkn->mgn", lhs, rhs)
    pick = _expert_of_row(sizes, lhs.shape[0]).clamp(max=rhs.shape[0] - 1)
    return every.gather(1, pick.view(-1, 1, 1).expand(-1, 1, every.shape[-1])).squeeze(1)


def local_tgmm(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``tgmm``'s contract in plain torch: for tests on the CPU."""
    groups = _count(sizes, sizes.shape[0])
    member = (_expert_of_row(sizes, lhs.shape[1])[None, :] == groups[:, None]).to(lhs.dtype)  # [groups, m]
    return torch.einsum("km,gm,mn->gkn", lhs, member, rhs)


Gmm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
Tgmm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _manual(fn: Callable[..., torch.Tensor], specs: tuple[tuple, ...], out_spec: tuple) -> Callable[..., torch.Tensor]:
    """``fn`` on each device's shard of its tensor arguments (torch_xla 2.9's ``custom_kernel._shard_map``)."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.custom_kernel import _shard_map

    mapped = _shard_map(fn, xs.get_global_mesh(), specs, (out_spec,))
    # Entering the region annotates each tensor in place, and one annotated before (a parameter's FSDP
    # sharding, the group sizes of the layer's first projection) refuses another: each enters as a new node
    # (a clone would keep the annotation; XLA folds the product away).
    return lambda *tensors: mapped(*(t * 1 for t in tensors))


STACK = (None, None, None)


def _split(rows: torch.Tensor) -> str | None:
    """The mesh axis the shards are split over: ``fsdp``, or none where the tokens came as one shard (a batch
    the devices do not divide, as one generated token): then every device computes all of them."""
    return "fsdp" if rows.shape[0] > 1 else None


def _forward(gmm: Gmm, rows: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor, transposed: bool) -> Any:
    def shard(r: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return gmm(r[0], w, s[0], not transposed)[None]

    axis = _split(rows)
    return _manual(shard, ((axis, None, None), STACK, (axis, None)), (axis, None, None))(rows, weight, sizes)


def _backward(
    kernels: tuple[Gmm, Tgmm],
    grad: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    sizes: torch.Tensor,
    transposed: bool,
    stack_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    gmm, tgmm = kernels
    axis = _split(rows)
    split, counts = (axis, None, None), (axis, None)

    def rows_grad(g: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return gmm(g[0], w, s[0], transposed)[None]

    grad_rows = _manual(rows_grad, (split, STACK, counts), split)(grad, weight, sizes)
    if not stack_grad:
        return grad_rows, None

    def weight_grad(g: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        # [out, in] per expert from grad^T @ rows; a transposed stack is [in, out]
        part = tgmm(r[0].t(), g[0], s[0]) if transposed else tgmm(g[0].t(), r[0], s[0])
        return part[None]

    shares = _manual(weight_grad, (split, split, counts), (axis, None, None, None))(grad, rows, sizes)
    return grad_rows, shares.sum(0)


def sharded_kernel(gmm: Gmm = tpu_gmm, tgmm: Tgmm = tpu_tgmm) -> Callable[..., torch.Tensor]:
    """``model.experts``' kernel: rows [shards, rows, in] split over the devices, the whole stack on each."""

    class GroupedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, rows, weight, sizes, transposed: bool):  # type: ignore[override]
            ctx.save_for_backward(rows, weight, sizes)
            ctx.transposed = transposed
            return _forward(gmm, rows, weight, sizes, transposed)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
            rows, weight, sizes = ctx.saved_tensors
            kernels = (gmm, tgmm)
            grad_rows, grad_weight = _backward(
                kernels, grad, rows, weight, sizes, ctx.transposed, ctx.needs_input_grad[1]
            )
            return grad_rows, grad_weight, None, None

    checked = [gmm is not tpu_gmm]

    def kernel(rows: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor, transposed: bool) -> torch.Tensor:
        if not checked[0]:
            require_torchax()
            checked[0] = True
        # The stack is gathered whole for the region; made to wait for this layer's rows, a checkpointed
        # layer's recomputation gathers it again instead of XLA keeping the forward's gathered copy (the
        # same ops on the same parameter) alive until the backward: 1.2 GB a layer for Qwen3-30B-A3B.
        return GroupedMatmul.apply(rows, after(weight, rows.flatten()[0]), sizes, transposed)

    return kernel


def require_torchax() -> None:
    """torch_xla 2.9 runs the megablox kernels through ``call_jax``, which needs torchax (the tpu, compiler and
    dev extras install it); its wheel's bundled copy needs flax and does not import."""
    try:
        import torchax  # noqa: F401  (imports jax)
    except ImportError as err:
        raise UserError(
            f"a MoE model's TPU kernels (megablox's grouped matmuls, through torch_xla's call_jax) need jax and "
            f"torchax ({err}); install them with: pip install -c constraints.txt -e '.[tpu]' (on a TPU VM) or "
            "'.[compiler]' (for memory --compile)"
        ) from None


def install(devices: int, kernel: Callable[..., torch.Tensor] | None = None) -> None:
    """Give ``model.experts`` the TPU kernel (or ``kernel``) and the devices the tokens are split over."""
    from lowmem_tpu.model.experts import provide_kernel

    provide_kernel(kernel or sharded_kernel(), devices)
