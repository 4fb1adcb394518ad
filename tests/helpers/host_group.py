"""A pod slice's host side without a TPU: N processes in a real gloo group, each running one scenario.

Multi-process SPMD cannot run on the CPU backend, so nothing here starts XLA: the scenarios exercise
what the hosts do around the SPMD program (who writes and speaks, agreed stops, host copies from every
host's shards, the data every host must build alike, sharded checkpoint files written by several hosts).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def run_hosts(scenario: str, count: int, workdir: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``count`` processes joined as hosts; every host's result, by index."""
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    procs = [context.Process(target=_host, args=(scenario, i, count, port, str(workdir), kwargs)) for i in range(count)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    results = []
    for i, p in enumerate(procs):
        path = workdir / f"host-{i}.json"
        assert p.exitcode == 0 and path.exists(), f"host {i} exited {p.exitcode}"
        results.append(json.loads(path.read_text()))
    errors = [r["error"] for r in results if r.get("error")]
    assert not errors, errors[0]
    return results


def _host(scenario: str, index: int, count: int, port: int, workdir: str, kwargs: dict[str, Any]) -> None:
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    from lowmem_tpu import hosts

    hosts.join(index, count, f"tcp://127.0.0.1:{port}")
    out: dict[str, Any] = {"index": index}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            out |= SCENARIOS[scenario](Path(workdir), **kwargs)
    except Exception:  # reported to the test, which fails with it
        out["error"] = traceback.format_exc()
    out["stdout"] = printed.getvalue()
    (Path(workdir) / f"host-{index}.json").write_text(json.dumps(out))
    hosts.leave()


def _stops(workdir: Path, stop_on: int, at_step: int) -> dict[str, Any]:
    """One host gets SIGTERM before step ``at_step`` ends: the step each host's guard stops at."""
    import signal

    from transformers import TrainerControl, TrainerState

    from lowmem_tpu import hosts
    from lowmem_tpu.train.guard import GuardCallback

    guard = GuardCallback(None, 0.0, print)
    state, control = TrainerState(), TrainerControl()
    for step in range(1, 10):
        state.global_step = step
        if step == at_step and hosts.current().index == stop_on:
            guard.request_stop(signal.SIGTERM, None)
        guard.on_step_end(None, state, control)
        if control.should_training_stop:
            return {"stopped_at": step, "saved": control.should_save, "reason": guard.stop_reason}
    return {"stopped_at": None}


def _host_copy(workdir: Path, drop_on: int | None = None) -> dict[str, Any]:
    """Each host holds its own rows of a tensor, as ``_get_local_shards`` gives them on a slice."""
    import torch

    from lowmem_tpu import hosts
    from lowmem_tpu.xla.transfer import IncompleteCopy, Piece, assemble

    whole = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    h = hosts.current()
    rows = 8 // h.count
    mine = [] if h.index == drop_on else [Piece((slice(h.index * rows, (h.index + 1) * rows), slice(0, 6)), None)]
    for piece in mine:
        piece.data = whole[piece.where].clone()
    everyone = hosts.gather_objects(mine)
    try:
        copy = assemble(whole.shape, whole.dtype, [p for pieces in everyone for p in pieces])
    except IncompleteCopy as err:
        return {"incomplete": str(err)}
    return {"equal": bool(torch.equal(copy, whole))}


def _shared(workdir: Path, same_dir: bool) -> dict[str, Any]:
    from lowmem_tpu import hosts
    from lowmem_tpu.console import say
    from lowmem_tpu.errors import UserError

    say(f"hello from host {hosts.current().index}")
    directory = workdir / ("out" if same_dir else f"out-{hosts.current().index}")
    directory.mkdir(exist_ok=True)
    try:
        hosts.check_shared(directory)
    except UserError as err:
        return {"refused": str(err)}
    return {"refused": None}


def _data(workdir: Path, different_on: int | None = None) -> dict[str, Any]:
    """Every host builds the run's data as a run does: host 0 writes the cache, the others read it."""
    from lowmem_tpu import hosts, run
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.errors import UserError

    overrides = [f"output_dir={workdir / 'run'}", "data.max_samples=64"]
    if hosts.current().index == different_on:
        overrides[1] = "data.max_samples=48"
    recipe = load_recipe("recipes/tiny_lora_cpu.yaml", overrides)
    (workdir / "run").mkdir(exist_ok=True)
    tokenizer = run._tokenizer(recipe)
    try:
        _, stats, _, _ = run._data(recipe, tokenizer, workdir / "run")
    except UserError as err:
        return {"refused": str(err)}
    return {"refused": None, "cached": stats["cached"], "digest": stats["rows_sha256"]}


def _dcp(workdir: Path) -> dict[str, Any]:
    """Each host writes only its rows of a sharded tensor (and host 0 the plain entries) into one checkpoint."""
    import torch
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards

    from lowmem_tpu import hosts
    from lowmem_tpu.xla.sharded_state import write

    h = hosts.current()
    whole = torch.arange(8 * 6, dtype=torch.bfloat16).reshape(8, 6)
    rows = 8 // h.count
    where = [slice(h.index * rows, (h.index + 1) * rows), slice(0, 6)]
    shards = _CpuShards(shards=[xs.XLAShard(whole[tuple(where)].clone(), where, "", 0)], global_shape=whole.shape)
    write({"trainable/w": shards, "optimizer/0/step": torch.tensor(3.0)}, workdir / "ckpt" / "state")
    return {"files": sorted(p.name for p in (workdir / "ckpt" / "state").iterdir())}


SCENARIOS = {"stops": _stops, "host_copy": _host_copy, "shared": _shared, "data": _data, "dcp": _dcp}
