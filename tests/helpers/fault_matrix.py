"""The fault matrix: runs killed at the fault points (``lowmem_tpu.faults``), what each kill left, the resume.

For each mode (LoRA; full fine-tuning with ``lora.enabled=false``) the tiny CPU recipe runs once
uninterrupted (``lowmem-tpu sft recipes/tiny_lora_cpu.yaml`` with the overrides in ``RUN``: 6 steps, a
checkpoint every 2, two kept, dropout on, two micro-batches per step). A case (``run_case``) runs the same
command with ``LOWMEM_TPU_KILL_AT=CASE`` (the process SIGKILLs itself at that point, the N-th time for
``POINT:N``), which must end it with SIGKILL; the directory it leaves is checked (``check_dir``: every
``checkpoints/step-N`` whole and loadable, ``final/`` whole if present, every data cache entry readable;
half-written ones only under names the next run removes or ignores); then the same command runs again,
unchanged, and must finish (exit 0) with ``final/*.safetensors`` equal to the uninterrupted run's, tensor by
tensor and byte for byte (``weight_difference``). Every run is the real CLI in a subprocess.

``benchmarks/fault_matrix.py`` runs every case (its record: benchmarks/results/fault_matrix.json, the table
in docs/faults.md); ``tests/e2e/test_faults.py`` runs a representative subset with the same settings and checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE = "recipes/tiny_lora_cpu.yaml"
RUN = [
    "train.max_steps=6",
    "train.save_steps=2",  # checkpoints at steps 2, 4 and 6; the third save prunes step-2
    "train.keep_last=2",
    "train.logging_steps=1",
    "train.global_batch_size=16",
    "train.gradient_accumulation_steps=2",
    "train.eval_samples=0",
    "data.eval_path=null",
    "lora.dropout=0.1",  # dropout draws from the XLA RNG, which a checkpoint must restore
]
MODES = {
    "lora": [],
    "full": ["lora.enabled=false", "train.learning_rate=1e-3"],
    "dpo": ["preference.loss_type=sigmoid", "train.eval_steps=null"],
}
COMMANDS = {"dpo": ("dpo", "recipes/tiny_dpo_cpu.yaml")}  # (command, recipe) of a mode; else sft of RECIPE
# (case, what the kill leaves); ``base`` exists in LoRA runs only, DPO's too (a random-init base is saved beside the
# adapter).
CASES = [
    ("cache", "a data cache entry written, not yet renamed: tokenization must run again"),
    ("base", "the random-init base half-saved (LoRA)"),
    ("step:1", "after the first step, before any checkpoint"),
    ("step:4", "after step 4, before its save (step-2 saved)"),
    ("save-state:1", "inside the first save: sharded state written, nothing else"),
    ("save-state:2", "inside the second save (step-2 complete)"),
    ("save-files:2", "inside the second save: every file but MANIFEST.json and COMPLETE"),
    ("save-complete:1", "the first save marked COMPLETE, not yet renamed to step-2"),
    ("save-complete:2", "the second save marked COMPLETE, not yet renamed to step-4"),
    ("save-prune:3", "step-6 published, step-2 not yet pruned"),
    ("final-weights", "final.partial holds the weights only"),
    ("final-publish", "final.partial whole, not yet renamed to final/"),
]
QUICK = {
    "lora": ["cache", "save-state:2", "save-complete:2", "final-publish"],
    "full": ["save-state:2"],
    "dpo": ["save-state:2"],
}


def env(kill: str | None = None) -> dict[str, str]:
    """The user's environment (the recipe picks the devices), with or without a fault point armed."""
    out = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "LOWMEM_TPU_KILL_AT")}
    out["PYTHONUNBUFFERED"] = "1"
    if kill:
        out["LOWMEM_TPU_KILL_AT"] = kill
    return out


def command(out: Path, mode: str) -> list[str]:
    verb, recipe = COMMANDS.get(mode, ("sft", RECIPE))
    return [sys.executable, "-m", "lowmem_tpu.cli", verb, recipe, f"output_dir={out}", *RUN, *MODES[mode]]


def sft(out: Path, mode: str, kill: str | None = None, timeout: int = 1200) -> subprocess.CompletedProcess[str]:
    """``lowmem-tpu sft`` (``dpo`` for the dpo mode) of this mode into ``out`` (killed at ``kill``, if given)."""
    return subprocess.run(command(out, mode), env=env(kill), capture_output=True, text=True, timeout=timeout)


def check_dir(out: Path) -> list[str]:
    """What in ``out`` the next run (or export, merge, generate) would misread; [] when nothing."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from lowmem_tpu.errors import UserError
    from lowmem_tpu.files import MANIFEST, check_whole, damage
    from lowmem_tpu.train import checkpoint as ckpt

    problems = []
    root = ckpt.checkpoints_dir(out)
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not ckpt.STEP_DIR.match(path.name):
            if path.name.endswith(".partial"):  # never resumed from; removed or replaced by the next run
                continue
            problems.append(f"checkpoints/{path.name}: an unexpected entry")
        elif not (path / ckpt.COMPLETE).is_file():
            problems.append(f"checkpoints/{path.name}: named as a checkpoint but not marked COMPLETE")
        elif problem := damage(path):
            problems.append(f"checkpoints/{path.name}: {problem}")
        else:
            trainable = ckpt.read_trainable(path)
            if not trainable or not all(torch.isfinite(t).all() for t in trainable.values()):
                problems.append(f"checkpoints/{path.name}: its trainable weights do not read back finite")
    try:
        ckpt.resolve_resume("auto", out)
    except UserError as err:
        problems.append(f"resume: {err}")
    final = out / "final"
    if final.exists():
        try:
            check_whole(final)
            json.loads((final / "metrics.json").read_text())
            if not (final / MANIFEST).is_file() or not list(final.glob("*.safetensors")):
                raise UserError("no MANIFEST.json or no weights")
            for weights in final.glob("*.safetensors"):
                load_file(str(weights))
        except (UserError, OSError, ValueError) as err:
            problems.append(f"final/: {err}")
    cache = out / "data_cache"
    for entry in sorted(cache.iterdir()) if cache.is_dir() else []:
        if entry.name.endswith(".partial"):
            continue  # replaced by the next write of that entry
        try:
            json.loads((entry / "stats.json").read_text())
            with np.load(entry / "rows.npz") as rows:
                if not {name: rows[name] for name in rows.files}:
                    raise ValueError("rows.npz holds no arrays")
        except (OSError, ValueError) as err:
            problems.append(f"data_cache/{entry.name}: {err}")
    return problems


def weight_difference(reference: Path, final: Path) -> str | None:
    """How ``final``'s ``*.safetensors`` differ from ``reference``'s (None: every tensor equal byte for byte)."""
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in reference.glob("*.safetensors"))
    if names != sorted(p.name for p in final.glob("*.safetensors")):
        return f"other weight files: {sorted(p.name for p in final.glob('*.safetensors'))} (expected {names})"
    for name in names:
        a, b = load_file(str(reference / name)), load_file(str(final / name))
        if a.keys() != b.keys():
            return f"{name}: other tensors ({len(b)}, expected {len(a)})"
        for key in sorted(a):
            x, y = a[key], b[key]
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{name}: {key} is {y.dtype} {tuple(y.shape)}, expected {x.dtype} {tuple(x.shape)}"
            if not x.contiguous().view(-1).view(torch.uint8).equal(y.contiguous().view(-1).view(torch.uint8)):
                diff = (x.double() - y.double()).abs().max().item()
                return f"{name}: {key} differs (max abs difference {diff:.3g})"
    return None


def tail(proc: subprocess.CompletedProcess[str], lines: int = 3) -> str:
    return " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-lines:])


def reference(work: Path, mode: str) -> Path:
    """The uninterrupted run of ``mode``: its ``final/``."""
    out = work / f"{mode}-uninterrupted"
    shutil.rmtree(out, ignore_errors=True)
    proc = sft(out, mode)
    if proc.returncode:
        raise RuntimeError(f"the uninterrupted {mode} run failed (exit {proc.returncode}): {tail(proc, 20)}")
    return out / "final"


def run_case(work: Path, mode: str, case: str, ref: Path, keep: bool = False) -> dict[str, Any]:
    """Kill a run at ``case``, check what it left, run the same command again, compare the weights with ``ref``."""
    out = work / f"{mode}-{case.replace(':', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    killed = sft(out, mode, kill=case)
    result: dict[str, Any] = {"case": case, "point": case.split(":")[0], "mode": mode, "exit": killed.returncode}
    problems = []
    if killed.returncode != -signal.SIGKILL:
        problems.append(f"not killed at {case} (exit {killed.returncode}: {tail(killed)})")
    left = check_dir(out)
    problems += [f"after the kill: {p}" for p in left]
    resumed = sft(out, mode)
    found = re.search(r"resuming from (\S+)", resumed.stdout)
    result["resumed_from"] = Path(found.group(1)).name if found else None
    if resumed.returncode:
        problems.append(f"the same command again exited {resumed.returncode}: {tail(resumed)}")
    else:
        problems += [f"after the re-run: {p}" for p in check_dir(out)]
        if difference := weight_difference(ref, out / "final"):
            problems.append(f"final weights: {difference}")
    result |= {"problems": problems, "survived": not problems, "seconds": round(time.perf_counter() - started, 1)}
    if result["survived"] and not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault point and mode: how many cases ran and how many survived."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        row = rows.setdefault((r["point"], r["mode"]), {"point": r["point"], "mode": r["mode"], "tried": 0})
        row["tried"] += 1
        row["survived"] = row.get("survived", 0) + int(r["survived"])
    return list(rows.values())


def table(results: list[dict[str, Any]]) -> str:
    """The matrix as Markdown: per fault point and mode, then each case (docs/faults.md's table)."""
    lines = ["| fault point | mode | tried | survived |", "|---|---|---|---|"]
    lines += [f"| `{r['point']}` | {r['mode']} | {r['tried']} | {r['survived']} |" for r in summary(results)]
    lines += ["", "| case | mode | exit of the killed run | the same command again resumed from | result |"]
    lines += ["|---|---|---|---|---|"]
    for r in results:
        verdict = "same weights, bit for bit" if r["survived"] else "FAILED: " + "; ".join(r["problems"])
        lines.append(f"| `{r['case']}` | {r['mode']} | {r['exit']} | {r['resumed_from'] or 'start'} | {verdict} |")
    return "\n".join(lines)
