"""What a person sees: stage messages, tables, and quiet library logs. Imports nothing heavy."""

from __future__ import annotations

import logging
import time
import warnings

_START: float | None = None


def say(message: str) -> None:
    """One stage line, with the seconds since the first one (on host 0 only: a pod slice's hosts say the same)."""
    from lowmem_tpu import hosts

    if not hosts.is_main():
        return
    global _START
    _START = _START or time.perf_counter()
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", flush=True)


def size(n: float | None) -> str:
    """Bytes as "1.23 GiB", or "12.3 MiB" below a GiB ("n/a" for None)."""
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def quiet_python_warnings() -> None:
    """Silence library warnings that say nothing actionable to a user of this tool."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("transformers", "torch_xla", "accelerate", "datasets", "peft", "trl", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - both are dependencies
        pass
