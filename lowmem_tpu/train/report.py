"""What a finished run reports: ``metrics.json`` (built from the run's callbacks) and the summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe


def run_metrics(
    recipe: Recipe,
    runtime: Any,
    job: Any,
    data_stats: dict[str, Any],
    evals: tuple[dict[str, Any], dict[str, Any]],
    result: Any,
    train_seconds: float,
    memory: dict[str, Any],
) -> dict[str, Any]:
    """``metrics.json``: what the run did (losses, throughput, compiles, evaluation, memory per device)."""
    before, after = evals
    from lowmem_tpu.xla.runtime import cache_stats, compile_count, compile_seconds, cpu_fallbacks

    cb = job.metrics
    steps = recipe.train.max_steps
    warmup = cb.warmup_end(steps)
    by_step = cb.compiles_by_step
    # A save at step s runs after step s is counted and before step s + 1 is: take it out of the steps.
    saves = job.trainer.save_compiles
    saved_in = lambda first, last: sum(c for s, c in saves.items() if first <= s < last)  # noqa: E731
    logs = [entry for entry in cb.logs if "loss" in entry]
    steady = [entry for entry in logs if entry["step"] > warmup and "tokens_per_second" in entry]
    mean = lambda key: sum(e[key] for e in steady) / len(steady) if steady else None  # noqa: E731
    trainable, total = job.trainable, job.total
    # A run resumed from its last checkpoint (killed while writing final/) trains no step: no loss, not 0.0.
    mean_loss = result.training_loss if cb.compiles_by_step else None
    return {
        "platform": runtime.platform,
        "device_kind": runtime.kind,
        "num_devices": runtime.num_devices,
        "mode": "lora" if recipe.lora.enabled else "full",
        "trainable_parameters": trainable,
        "total_parameters": total,
        "steps": steps,
        "global_batch_size": recipe.train.global_batch_size,
        "micro_batch_size": job.micro,
        "max_length": recipe.data.max_length,
        "data": data_stats,
        "train": {
            "losses": [{"step": e["step"], "loss": e["loss"]} for e in logs],
            "log": cb.logs,
            "final_loss": logs[-1]["loss"] if logs else mean_loss,
            "mean_loss": mean_loss,
            "steady_tokens_per_second": mean("tokens_per_second"),
            "steady_tokens_per_second_per_device": mean("tokens_per_second_per_device"),
            "steady_step_time": mean("step_time"),
            "steady_mfu": mean("mfu") if runtime.peak_flops else None,
            "flops_per_token": job.flops_per_token,
        },
        "eval": {"before": before, "after": after},
        "compiles": {
            "warmup_steps": warmup,
            "during_warmup": by_step.get(warmup, 0) - saved_in(0, warmup),
            "after_warmup": by_step.get(steps, 0) - by_step.get(warmup, 0) - saved_in(warmup, steps),
            "at_saves": {str(step): count for step, count in sorted(saves.items())},
            "total": compile_count() - cb.compiles_at_start,
            "seconds": round(compile_seconds() - cb.compile_seconds_at_start, 2),
            "persistent_cache": {"dir": runtime.compile_cache_dir, **cache_stats()},
            "cpu_fallbacks": cpu_fallbacks(),
        },
        "memory": memory,
        "checkpoints": {"seconds": {str(s): t for s, t in sorted(job.trainer.save_seconds.items())}},
        "time": {"train_seconds": round(train_seconds, 1)},
    }


def print_summary(metrics: dict[str, Any], final: Path) -> None:
    """The short table a run ends with."""
    from lowmem_tpu.console import table

    before, after = metrics["eval"]["before"], metrics["eval"]["after"]
    rows = [
        ("mode", f"{metrics['mode']} on {metrics['num_devices']} {metrics['platform']} devices"),
        ("steps", str(metrics["steps"])),
        ("train loss (last log)", _fmt(metrics["train"]["final_loss"])),
    ]
    for key, name in (("loss", "eval loss"), ("exact_match", "exact match")):
        if key in before or key in after:
            rows.append((name, f"{_fmt(before.get(key))} -> {_fmt(after.get(key))}"))
    tps = metrics["train"]["steady_tokens_per_second"]
    rows += [
        ("tokens/s (steady)", f"{tps:,.0f}" if tps else "n/a"),
        ("compiles", _compiles(metrics["compiles"])),
        ("output", str(final)),
    ]
    print("\nsummary\n" + table(rows), flush=True)


def _compiles(c: dict[str, Any]) -> str:
    saves = list(c["at_saves"].values())
    at_saves = f", {sum(saves)} at {len(saves)} saves" if saves else ""
    fallbacks = f"; ran on the host: {', '.join(c['cpu_fallbacks'])}" if c.get("cpu_fallbacks") else ""
    return f"{c['during_warmup']} in warm-up, {c['after_warmup']} after{at_saves}{fallbacks}"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
