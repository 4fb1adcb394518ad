"""Deterministic fault points: a SIGKILL at a named moment of a run, for the fault matrix.

``LOWMEM_TPU_KILL_AT=NAME`` kills this process (SIGKILL: no handler, no cleanup, as a preemption or the OOM
killer would) the first time it reaches the point NAME; ``NAME:N`` the N-th time, counted from 1 in this
process (``step:3``: at the end of the third step it trains; ``save-state:2``: inside its second save).
Unset, a point costs one environment lookup. ``benchmarks/fault_matrix.py`` and ``tests/e2e/test_faults.py`` kill
runs at every point and check that the same command then finishes with the uninterrupted run's weights.

The points, in the order a run reaches them:

  cache          data cache: an entry's rows and stats written in KEY.partial, not yet renamed to KEY
  base           the random-init base's weights saved in output_dir/base, its tokenizer not yet
  step           the end of an optimizer step, before that step's checkpoint (if any) is saved
  save-state     a checkpoint's sharded state written in step-N.partial, its small files not yet
  save-files     the small files written too (optimizer groups, scheduler, RNG, trainer state, export/)
  save-complete  MANIFEST.json and COMPLETE written; still named step-N.partial
  save-prune     renamed to step-N; the checkpoints beyond train.keep_last not deleted yet
  final-weights  final.partial holds the weights; tokenizer, recipe, metrics and manifest not yet
  final-publish  final.partial is whole (its MANIFEST.json written), not yet renamed to final/
"""

from __future__ import annotations

import os
import signal

ENV = "LOWMEM_TPU_KILL_AT"
POINTS = (
    "cache",
    "base",
    "step",
    "save-state",
    "save-files",
    "save-complete",
    "save-prune",
    "final-weights",
    "final-publish",
)
_reached: dict[str, int] = {}


def point(name: str) -> None:
    """Kill this process here when ``LOWMEM_TPU_KILL_AT`` is ``name`` or ``name:N`` (the N-th time here)."""
    target = os.environ.get(ENV)
    if not target:
        return
    wanted, _, nth = target.partition(":")
    if wanted != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
