"""Writing outputs so that a crash never leaves half of one: build beside it, then rename into place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


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
