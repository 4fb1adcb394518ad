"""The loss curve of a run as a picture: ``metrics.jsonl`` (one JSON line per log, as the run goes) drawn
as loss and eval loss, learning rate and tokens/s against the step, in one PNG.

``sft`` draws ``final/loss.png`` when a run ends; ``lowmem-tpu plot RUN_DIR`` draws it for a run that is
still going (the file is flushed at every log). Only the standard library is imported here, and matplotlib
(the optional ``[plot]`` extra) inside ``draw``: a notebook can redraw the curve every few seconds
without loading torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError

JSONL = "metrics.jsonl"  # the run's log (train.metrics writes it); named here, where no transformers loads
LOSS_PNG = "loss.png"
MISSING = "matplotlib is not installed: pip install -c constraints.txt matplotlib (the [plot] extra)"
_UP = 3  # output_dir/checkpoints/step-N is two levels below the run, final/ one


def find_run(path: str | Path) -> Path:
    """The run directory holding ``metrics.jsonl``: PATH itself, or the nearest of its parents within
    three levels (so ``final/`` or ``checkpoints/checkpoint-N`` name their run); a UserError if none."""
    path = Path(path)
    if path.is_file() and path.name == JSONL:
        return path.parent
    start = path.resolve()
    for candidate in [start, *start.parents][: _UP + 1]:
        if (candidate / JSONL).is_file():
            return candidate
    where = "does not exist" if not path.exists() else f"holds no {JSONL} (nor do the {_UP} folders above it)"
    raise UserError(f"{path} {where}: give a run's output_dir, where sft writes {JSONL} as it trains")


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The log entries of ``run_dir/metrics.jsonl`` in order; a line cut by a crash (or being written) is skipped."""
    entries = []
    for line in (Path(run_dir) / JSONL).read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int | float):
            entries.append(entry)
    return entries


def _series(entries: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(e["step"], e[key]) for e in entries if isinstance(e.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps logged, the last training loss and the best evaluation loss (with their steps)."""
    steps, losses = _series(entries, "loss")
    eval_steps, eval_losses = _series(entries, "eval_loss")
    best = min(range(len(eval_losses)), key=eval_losses.__getitem__) if eval_losses else None
    return {
        "steps": max((e["step"] for e in entries), default=0),
        "logs": len(losses),
        "last_loss": losses[-1] if losses else None,
        "last_loss_step": steps[-1] if steps else None,
        "best_eval_loss": eval_losses[best] if best is not None else None,
        "best_eval_step": eval_steps[best] if best is not None else None,
        "finished": any("train_runtime" in e for e in entries),
    }


def describe(summary: dict[str, Any]) -> str:
    """One line: ``12 steps, last loss 1.2345 (step 12), best eval loss 1.3456 (step 12)``."""
    fmt = lambda value, step: "n/a" if value is None else f"{value:.4f} (step {step:g})"  # noqa: E731
    state = "finished" if summary["finished"] else "running or stopped"
    return (
        f"{summary['steps']:g} steps ({state}), last loss {fmt(summary['last_loss'], summary['last_loss_step'])}, "
        f"best eval loss {fmt(summary['best_eval_loss'], summary['best_eval_step'])}"
    )


def draw(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` to ``out`` (default ``run_dir/loss.png``): loss and eval loss, learning
    rate and tokens/s, sharing the step axis, titled with the run directory. A UserError when matplotlib is
    missing. The first steps' tokens/s include their compilation."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(MISSING) from None
    matplotlib.use("Agg")  # files only: no display, and safe in a notebook kernel or a training process
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    entries = read_log(run_dir)
    out = Path(out) if out is not None else run_dir / LOSS_PNG
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8), height_ratios=(2, 1, 1))
    try:
        panels = (
            (axes[0], (("loss", "train loss", "C0"), ("eval_loss", "eval loss", "C1")), "loss"),
            (axes[1], (("learning_rate", "learning rate", "C2"),), "learning rate"),
            (axes[2], (("tokens_per_second", "tokens/s", "C3"),), "tokens/s"),
        )
        for ax, lines, ylabel in panels:
            drawn = False
            for key, label, color in lines:
                steps, values = _series(entries, key)
                if steps:
                    marker = "o" if key.startswith("eval_") or len(steps) < 20 else None
                    size = 5 if key.startswith("eval_") else 3
                    ax.plot(steps, values, label=label, color=color, marker=marker, markersize=size)
                    drawn = True
            if not drawn:
                ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        if any(line.get_label() == "eval loss" for line in axes[0].get_lines()):
            axes[0].legend(fontsize=8)
        axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        axes[2].set_xlabel("step")
        axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(f"{run_dir}\n{describe(summarize(entries))}", fontsize=9)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")  # a reader never sees half a picture
        fig.savefig(partial, dpi=100, format="png")
        partial.replace(out)
    finally:
        plt.close(fig)
    return out


def plot_finished_run(run_dir: str | Path, final: str | Path) -> str:
    """``final/loss.png`` at the end of ``sft``; never raises (a picture must not fail a run): says what happened."""
    try:
        return f"loss curve: {draw(run_dir, Path(final) / LOSS_PNG)}"
    except UserError as err:
        return f"no loss curve: {err}"
    except Exception as err:
        return f"no loss curve: drawing it failed ({type(err).__name__}: {err})"
