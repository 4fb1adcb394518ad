"""SIGKILL at the fault points (``lowmem_tpu.faults``) through the real CLI: the same command then finishes
with the uninterrupted run's weights, bit for bit, and no kill leaves a directory that is misread.

A representative subset of the fault matrix (``tests/helpers/fault_matrix.py``, whose every point, LoRA, full and
DPO, ``benchmarks/fault_matrix.py`` runs), with its settings and checks: the uninterrupted LoRA run, then a LoRA
run killed four times in a row (while tokenizing, inside its second save, with a checkpoint marked COMPLETE but
not yet renamed, with final/ written but not yet renamed). Along the way the next start removes the half-written
checkpoint, and the steps trained after a resume log the uninterrupted run's losses (dropout on, 2 micro-batches
a step): LoRA's exact resume.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import fault_matrix as matrix
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """Each mode's uninterrupted final/, made on first use."""
    work, made = tmp_path_factory.mktemp("uninterrupted"), {}

    def final(mode: str) -> Path:
        if mode not in made:
            made[mode] = matrix.reference(work, mode)
        return made[mode]

    return final


def _kill(out: Path, mode: str, case: str) -> str:
    """Run until SIGKILLed at ``case``; what it printed."""
    proc = matrix.sft(out, mode, kill=case)
    assert proc.returncode == -signal.SIGKILL, (case, proc.returncode, proc.stderr[-3000:])
    assert matrix.check_dir(out) == [], case
    return proc.stdout


def _losses(final: Path) -> dict[int, float]:
    """The logged loss of each step a run trained, from the ``metrics.json`` in ``final``."""
    return {e["step"]: e["loss"] for e in json.loads((final / "metrics.json").read_text())["train"]["losses"]}


def test_a_lora_run_killed_while_tokenizing_saving_marking_and_publishing_resumes_bit_for_bit(references, tmp_path):
    out = tmp_path / "run"
    _kill(out, "lora", "cache")  # the rows written in data_cache/KEY.partial, not renamed
    assert not (out / "checkpoints").exists()
    assert [p.name.endswith(".partial") for p in (out / "data_cache").iterdir()] == [True]

    _kill(out, "lora", "save-files:2")  # tokenizes again; step-2 saved, killed inside step-4's save
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4.partial"]
    assert not (checkpoints / "step-4.partial" / "COMPLETE").exists()

    printed = _kill(out, "lora", "save-complete:1")  # resumes from step-2; step-4.partial marked COMPLETE, not renamed
    # the half-written step-4.partial (no COMPLETE) removed at the start, before this run writes its own
    assert f"removed an incomplete checkpoint: {checkpoints / 'step-4.partial'}" in printed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4.partial"]
    assert (checkpoints / "step-4.partial" / "COMPLETE").exists()

    printed = _kill(out, "lora", "final-publish")  # never resumes from the unrenamed step-4: step-2 again
    assert f"resuming from {checkpoints / 'step-2'}" in printed
    assert (out / "final.partial").is_dir() and not (out / "final").exists()
    # final.partial/ is whole: the losses of the steps trained after the resume from step-2 (dropout on)
    resumed, whole = _losses(out / "final.partial"), _losses(references("lora"))
    assert sorted(resumed) == [3, 4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], abs=1e-6), (step, loss, whole[step])
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-6"]  # step-4 written by the re-run

    again = matrix.sft(out, "lora")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {checkpoints / 'step-6'}" in again.stdout
    assert not (out / "final.partial").exists() and matrix.check_dir(out) == []
    assert matrix.weight_difference(references("lora"), out / "final") is None
