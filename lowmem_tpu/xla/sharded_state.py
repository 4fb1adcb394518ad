"""Sharded state to and from disk in ``torch.distributed.checkpoint`` (DCP) form: each host its own shards.

torch_xla 2.9's ``SPMDSavePlanner`` / ``SPMDLoadPlanner`` (experimental/distributed_checkpoint/planners.py)
write every host's local shards into one directory (host 0 adds ``.metadata``) and load into tensors
already placed on the devices, reading only the regions each device holds: a checkpoint saved on 4
devices restores on 8 and back. The shards are fetched with one graph cut and no compilation
(``transfer.local_pieces``) and handed to the planner as ``_CpuShards`` (planners.py,
``_create_write_items_for_cpu_shards``), so the values written are the ones the caller checked.
One host runs the same code without a process group (DCP's ``no_dist``); several use the host group.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from lowmem_tpu import hosts
from lowmem_tpu.xla.transfer import cut_step, is_sharded, local_pieces, plain_copies


def fetch(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each XLA tensor replaced by this host's part of it: ``_CpuShards`` or a host tensor."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards

    cut_step()
    on_device = {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor) and v.device.type == "xla"}
    sharded = [k for k, v in on_device.items() if is_sharded(v)]
    plain = [k for k in on_device if k not in sharded]
    out = dict(state)
    out.update(zip(plain, plain_copies([on_device[k] for k in plain]), strict=True))
    for key, pieces in zip(sharded, local_pieces([on_device[k] for k in sharded]), strict=True):
        tensor = on_device[key]
        if len(pieces) == 1 and pieces[0].where is None:
            out[key] = pieces[0].data
            continue
        shards = [xs.XLAShard(p.data, list(p.where), "", 0) for p in pieces]  # type: ignore[arg-type]
        out[key] = _CpuShards(shards=shards, global_shape=tensor.shape)
    return out


def host_values(value: Any) -> list[torch.Tensor]:
    """The host tensors a fetched value holds (the shards of ``_CpuShards``, or the tensor)."""
    shards = getattr(value, "shards", None)
    if shards is not None:
        return [s.data for s in shards]
    return [value] if isinstance(value, torch.Tensor) else []


def write(fetched: dict[str, Any], directory: Path) -> None:
    """Write what :func:`fetch` returned as one DCP checkpoint (collective on several hosts)."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    # Host tensors are copied in turn (no copy-ahead): DCP's overlapping loader asks the device module of
    # the registered privateuse1 backend for a stream, and torchax (a MoE model's TPU kernels need it, and
    # torch_xla imports it whenever it is installed) registers one without streams.
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, per_thread_copy_ahead=0)
    with warnings.catch_warnings():  # DCP warns that one process without a group is one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(fetched, storage_writer=writer, planner=SPMDSavePlanner(), no_dist=not hosts.several())


def load_into(targets: dict[str, Any], directory: Path) -> None:
    """Fill ``targets`` in place from a DCP checkpoint: XLA tensors get only their devices' regions.

    Non-tensor entries (placeholders) are replaced by the saved objects.
    """
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    reader = dcp.FileSystemReader(str(directory))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=reader, planner=SPMDLoadPlanner(), no_dist=not hosts.several())
