"""Copying device state to the host without compiling anything: one graph cut, then raw shards.

torch_xla copies a sharded tensor to the host by compiling a program that replicates it
(``ReplicateShardedData``) and does so again at every copy, one program per tensor: a checkpoint
of 168 LoRA tensors compiled 168 programs every time. Each device's shard is already a buffer,
so here the shards are fetched as they are (``_get_local_shards``, with the index ranges from
``_get_local_shard_replica_and_indices``: what torch_xla 2.9's distributed checkpoint planners use,
experimental/distributed_checkpoint/_helpers.py) and the tensor is reassembled on the host.
On a pod slice each host holds only its own devices' shards: the pieces are gathered over the host
group (``lowmem_tpu.hosts``), and every copy is checked to cover its whole tensor, so a region no
shard filled can never pass as data (``torch.empty`` would have left it uninitialised, silently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lowmem_tpu import hosts


class IncompleteCopy(RuntimeError):
    """A host copy that some region of the tensor never reached."""


@dataclass
class Piece:
    """One device's shard on the host: where it sits in the whole tensor (``None``: it is the whole)."""

    where: tuple[slice, ...] | None
    data: torch.Tensor


def to_host(tree: Any) -> Any:
    """A nested state (dicts, lists, tuples) with every XLA tensor copied to the host.

    The step is finished first (:func:`cut_step`). Host tensors and non-tensors are left as they are.
    """
    cut_step()
    leaves, spec = tree_flatten(tree)
    on_device = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.device.type == "xla"]
    tensors = [leaves[i].detach() for i in on_device]
    sharded = [is_sharded(t) for t in tensors]
    host_plain = iter(plain_copies([t for t, s in zip(tensors, sharded, strict=True) if not s]))
    host_sharded = iter(_assemble([t for t, s in zip(tensors, sharded, strict=True) if s]))
    for i, with_shards in zip(on_device, sharded, strict=True):
        leaves[i] = next(host_sharded) if with_shards else next(host_plain)
    return tree_unflatten(leaves, spec)


def cut_step() -> None:
    """Finish the pending step (one graph cut), keeping the XLA RNG seed as it was.

    A tensor copied while the step is still pending would rerun the whole step for that one tensor;
    shards cannot be read while the step that writes them is in flight. That graph is the step the
    device loader would have cut anyway, so it is a cache hit. A graph cut advances the XLA RNG seed,
    so the seed is put back: a run that saves draws the same dropout masks as one that does not.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    seed = xm.get_rng_state()
    torch_xla.sync(wait=True)
    xm.set_rng_state(seed)


def is_sharded(tensor: torch.Tensor) -> bool:
    import torch_xla

    return bool(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def plain_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of XLA tensors that are not sharded (each device holds the whole tensor)."""
    import torch_xla

    return list(torch_xla._XLAC._xla_get_cpu_tensors(tensors)) if tensors else []


def _assemble(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of sharded tensors, put together from every host's shards (padding dropped)."""
    pieces = local_pieces(tensors)
    if hosts.several():  # each host sees only its own devices' shards
        everyone = hosts.gather_objects(pieces)
        pieces = [[p for host in everyone for p in host[i]] for i in range(len(tensors))]
    return [assemble(t.shape, t.dtype, p) for t, p in zip(tensors, pieces, strict=True)]


def local_pieces(tensors: list[torch.Tensor]) -> list[list[Piece]]:
    """This host's shards of each sharded tensor, unpadded, one per distinct region (replicas dropped)."""
    import torch_xla

    if not tensors:
        return []
    shards = torch_xla._XLAC._get_local_shards(tensors)
    places = torch_xla._XLAC._get_local_shard_replica_and_indices(tensors)
    out = []
    for tensor_shards, tensor_places in zip(shards, places, strict=True):
        pieces: dict[Any, Piece] = {}
        for (data, _device), (_replica, indices) in zip(tensor_shards, tensor_places, strict=True):
            if indices is Ellipsis:  # replicated: any shard is the whole tensor
                pieces = {None: Piece(None, data)}
                break
            key = tuple((s.start, s.stop) for s in indices)
            if key not in pieces:
                pieces[key] = Piece(tuple(indices), data[tuple(slice(0, s.stop - s.start) for s in indices)])
        out.append(list(pieces.values()))
    return out


def assemble(shape: torch.Size, dtype: torch.dtype, pieces: list[Piece]) -> torch.Tensor:
    """The whole tensor from its pieces; ``IncompleteCopy`` unless they cover every element.

    Tiles of one sharding never overlap, so the distinct pieces' sizes must add up to the tensor's.
    """
    whole = torch.empty(shape, dtype=dtype)
    covered = 0
    for piece in pieces:
        if piece.where is None:
            return whole.copy_(piece.data)
        whole[piece.where] = piece.data
        covered += piece.data.numel()
    if covered != whole.numel():
        raise IncompleteCopy(
            f"a host copy of a {tuple(shape)} tensor got {covered} of its {whole.numel()} elements from its shards"
        )
    return whole
