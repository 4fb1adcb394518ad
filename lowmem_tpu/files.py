"""Writing outputs so that a crash never leaves half of one: build beside it, then rename into place."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError

LOCK = ".lowmem-tpu.lock"


def checkpoint_instead(directory: Path) -> UserError | None:
    """The error for a training checkpoint given where an adapter or a model is expected (None otherwise)."""
    if (directory / "COMPLETE").is_file() and (directory / "state").is_dir():
        return UserError(
            f"{directory} is a training checkpoint (sharded state); turn it into an adapter or a model first: "
            f"lowmem-tpu export {directory} --out DIR"
        )
    return None


def fresh_partial(final: Path, suffix: str = ".partial") -> Path:
    """An empty directory beside ``final`` to build it in (a leftover from a crash is removed first)."""
    partial = final.with_name(final.name + suffix)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, final: Path) -> None:
    """Make a finished output visible in one rename (the previous one, if any, is replaced)."""
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as indented JSON with a final newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def holding(directory: Path, field: str) -> Iterator[None]:
    """An advisory lock on ``directory`` while the block runs; exit 2 naming the holder if another process has it.

    ``flock`` on ``directory/.lowmem-tpu.lock``: the kernel drops it when the holder exits, however it
    exits (a killed run never blocks the next one).
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(
                f"{field}: {directory} is in use by {holder}; wait for that run to end (or stop it), "
                f"or choose another {field}"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"lowmem-tpu (pid {os.getpid()} on {socket.gethostname()})\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
