"""Which host this process is, and the few things hosts must agree on. The one place that knows.

A pod slice runs the same command on every TPU VM; one SPMD program spans all their chips, but
everything on the host side happens once per host. The rule: a file, a log line, a report, a push
or the data cache happens on host 0 (``is_main()``), or on every host by design (reading data,
writing its own checkpoint shards). A decision that ends the SPMD program (SIGTERM, wall time) is
agreed over the host group (``agree_stop``), or the hosts that did not stop hang in the next
collective.

The group is a CPU process group (gloo). On a TPU slice ``xla.runtime.setup_runtime`` starts it with
torch_xla's ``xla://`` rendezvous; one host (every single VM, the CPU backend) has no group and
every function here is a local no-op. Tests start real gloo groups of several processes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError


@dataclass(frozen=True)
class Host:
    index: int = 0
    count: int = 1
    grouped: bool = False  # in the host group (after ``leave`` a host keeps its index, the group is gone)

    @property
    def main(self) -> bool:
        return self.index == 0


_HOST = Host()


def join(index: int, count: int, init_method: str | None = None) -> Host:
    """Record this process as host ``index`` of ``count``; several hosts start (or reuse) a gloo group."""
    global _HOST
    if count > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=index, world_size=count)
    _HOST = Host(index, count, grouped=count > 1)
    return _HOST


def leave() -> None:
    """End the host group once every host is done (a gloo group left open aborts the process at exit).

    The host keeps its index: host 0 still reports; collectives become local no-ops."""
    global _HOST
    if several():
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        _HOST = Host(_HOST.index, _HOST.count, grouped=False)


def current() -> Host:
    return _HOST


def is_main() -> bool:
    """True on host 0 (and on every single-host run): the one that writes, logs and pushes."""
    return _HOST.main


def several() -> bool:
    """True while this process is one of several hosts in the host group."""
    return _HOST.grouped


def barrier() -> None:
    """Wait until every host gets here (a no-op on one host)."""
    if several():
        import torch.distributed as dist

        dist.barrier()


def agree_stop(reason: str | None) -> str | None:
    """The stop every host takes at this step: the first host's reason if any host has one, else None.

    One all-gather of a short string per call over gloo; on one host it returns ``reason`` as it is.
    """
    if not several():
        return reason
    reasons = gather_objects(reason)
    return next((r for r in reasons if r is not None), None)


def gather_objects(value: Any) -> list[Any]:
    """Every host's ``value``, by host index, on every host ([value] on one host)."""
    if not several():
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * _HOST.count
    dist.all_gather_object(out, value)
    return out


def broadcast(value: Any) -> Any:
    """Host 0's ``value`` on every host."""
    if not several():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def disagreement(what: str, value: Any) -> str | None:
    """None when every host holds the same ``value`` (compared by a hash), else a line naming who differs."""
    if not several():
        return None
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
    digests = gather_objects(digest)
    odd = [i for i, d in enumerate(digests) if d != digests[0]]
    return f"{what} differs between hosts: host(s) {odd} against host 0" if odd else None


def all_true(flag: bool) -> bool:
    """True when ``flag`` holds on every host."""
    if not several():
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return int(value.item()) == 0


def check_shared(directory: Path) -> None:
    """On several hosts: a UserError unless every host sees ``directory`` as one (a shared disk).

    Host 0 writes a fresh token there; every host must read it back. Checkpoints need this: each host
    writes its own shards into the same checkpoint directory.
    """
    if not several():
        return
    token = directory / ".lowmem-tpu-hosts"
    nonce = broadcast(secrets.token_hex(8) if is_main() else None)
    if is_main():
        token.write_text(nonce)
    barrier()
    seen = token.is_file() and token.read_text() == nonce
    if not all_true(seen):
        raise UserError(
            f"output_dir: {directory} is not one directory every host sees (host {_HOST.index} "
            f"{'sees it' if seen else 'does not'}); on a pod slice use a shared disk (Filestore NFS, a "
            "gcsfuse mount of a bucket) mounted at the same path on every host"
        )
