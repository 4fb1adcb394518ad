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
MANIFEST = "MANIFEST.json"
HASHED_UP_TO = 64 * 2**20  # files up to this size are hashed; bigger ones (weight shards) are checked by size


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
    """``data`` as indented JSON with a final newline, written beside and renamed in (never half a file)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    partial.replace(path)


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


@contextlib.contextmanager
def holding_output(directory: Path, field: str) -> Iterator[None]:
    """:func:`holding` for a command's output that may lie inside (or around) a run's ``output_dir``.

    Besides ``directory`` itself, every directory above it (``--out run/final``, ``--out run/x/y``) and below
    it (``--force`` replaces what is there) that holds a lock file is locked too: a live run or another
    writer there is refused by name, and a run started there meanwhile is refused. The lock file this puts
    in ``directory`` is removed at the end (a written output is not a run's directory), and so is
    ``directory`` if this made it and nothing was written.
    """
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{field} {directory} is a file; give a directory")
    directory = directory.expanduser().resolve()
    existed, had_lock = directory.exists(), (directory / LOCK).exists()
    with contextlib.ExitStack() as stack:
        for outer in reversed(directory.parents):  # outermost first
            if (outer / LOCK).is_file():
                stack.enter_context(holding(outer, field))
        inner = sorted(p.parent for p in directory.rglob(LOCK) if p.parent != directory) if existed else []
        for path in inner:
            stack.enter_context(holding(path, field))
        stack.enter_context(holding(directory, field))
        try:
            yield
        finally:
            if not had_lock and (directory / LOCK).exists():
                (directory / LOCK).unlink()  # still held: nobody else can have taken it meanwhile
            if not existed and directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def write_manifest(directory: Path) -> None:
    """Record every file under ``directory`` (its size, and its SHA-256 up to 64 MiB) in ``MANIFEST.json``.

    Written last, after everything it lists: a directory whose files still match it is whole. Files
    over 64 MiB (a full model's shards) are checked by size, which finds a truncated or missing file;
    hashing gigabytes at every save would cost more than the save.
    """
    entries = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = path.stat().st_size
        entries[path.relative_to(directory).as_posix()] = {"bytes": size, "sha256": _sha256(path, size)}
    write_json(directory / MANIFEST, {"files": entries})


def damage(directory: Path, suffix: str = "") -> str | None:
    """What differs between ``directory`` and its manifest, for the files named ``*suffix`` (None: whole)."""
    manifest = directory / MANIFEST
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return f"{manifest} is missing or unreadable"
    for name, entry in entries.items():
        if not name.endswith(suffix):
            continue
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size:,} bytes, {entry['bytes']:,} were written"
        if entry.get("sha256") and _sha256(path, size) != entry["sha256"]:
            return f"{name} does not hold what was written (its SHA-256 differs)"
    return None


def check_whole(directory: Path) -> None:
    """A UserError naming the damage when the weights in ``directory`` no longer match its manifest.

    Only the weights (``*.safetensors``): configs and tokenizer files are the user's to edit (a moved
    adapter's base path, a chat template)."""
    if not (directory / MANIFEST).is_file():
        return  # written elsewhere (a merged model, an older run): nothing to check against
    problem = damage(directory, ".safetensors")
    if problem:
        raise UserError(
            f"{directory} is damaged: {problem}; it is not what the run wrote (copy it again, or use a checkpoint: "
            "lowmem-tpu export output_dir/checkpoints/step-N --out DIR)"
        )


def _sha256(path: Path, size: int) -> str | None:
    if size > HASHED_UP_TO:
        return None
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def disk_full(err: BaseException) -> bool:
    """ENOSPC, however a library wrapped it (safetensors and DCP put it in their own errors' text)."""
    import errno

    return getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)


def check_room(directory: Path, needed: int, what: str) -> None:
    """A UserError before writing ``what`` when the disk under ``directory`` has less than ``needed`` free."""
    from lowmem_tpu.console import size

    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise UserError(
            f"{what} needs {size(needed)} on the disk of {directory}, which has {size(free)} free: free space "
            "there, choose another output_dir, or lower train.keep_last (nothing written so far is lost)"
        )
