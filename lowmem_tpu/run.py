"""A training run (``lowmem-tpu sft``, ``dpo``, ``orpo``, ...): one recipe in, one ``output_dir/final`` out,
readable top to bottom.

recipe -> runtime -> tokenizer + data -> base model -> LoRA / full -> sharded model
-> the method's trainer (``train.methods``) -> adapter or full model, tokenizer, recipe.yaml, metrics.json

This module composes the folders (``config``, ``xla``, ``model``, ``data``, ``train``,
``publish``); it holds no technique of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_tpu import faults, hosts
from lowmem_tpu.config import Recipe, micro_batch_size
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.console import say
from lowmem_tpu.errors import UserError

if TYPE_CHECKING:  # the types of a run's state, imported when the run builds it
    import torch
    from transformers import PreTrainedTokenizerBase

    from lowmem_tpu.memory.plan import Plan
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.train.guard import GuardCallback
    from lowmem_tpu.train.metrics import MetricsCallback
    from lowmem_tpu.train.preference import XlaPreferenceTrainer
    from lowmem_tpu.train.trainer import XlaSFTTrainer
    from lowmem_tpu.xla.runtime import Runtime


def prepare_output(recipe: Recipe, overwrite: bool) -> Path:
    out = Path(recipe.output_dir)
    final = out / "final"
    if final.exists() and any(final.iterdir()) and not overwrite:
        raise UserError(
            f"output_dir: {final} already holds a finished run; choose another output_dir=... "
            "or pass --overwrite to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass(kw_only=True)
class TrainingRun:
    """What a finished run leaves: its metrics, its output, and the live (sharded) model."""

    metrics: dict[str, Any]
    final_dir: Path | None  # final/, or the checkpoint a stopped run saved (None if it saved none)
    trainer: XlaSFTTrainer | XlaPreferenceTrainer  # ``trainer.fsdp_model`` is the trained, wrapped model
    names: ParamNames  # of the unwrapped model
    stopped: str | None = None  # "SIGTERM", "SIGINT" or "max_wall_time" when it saved and stopped early


@dataclass(frozen=True, kw_only=True)
class Job:
    """One run's live state, from the built model to the trainer that trains it."""

    model: torch.nn.Module  # the unwrapped (PEFT) model; its parameters live sharded on the devices
    names: ParamNames  # taken before wrapping
    trainer: XlaSFTTrainer | XlaPreferenceTrainer
    metrics: MetricsCallback
    guard: GuardCallback
    base: str  # where the adapter's base lives (recorded in adapter_config.json)
    trainable: int  # trainable parameters
    total: int  # all parameters
    micro: int  # samples per forward pass over all devices
    runtime: Runtime
    tokenizer: PreTrainedTokenizerBase
    flops_per_token: float
    plan: Plan | None  # this run on its devices (None for an architecture the planner lacks)


def run_training(recipe: Recipe, overwrite: bool = False, force_resume: bool = False) -> TrainingRun:
    """Train as the recipe says and write ``output_dir/final`` (or a checkpoint, if stopped early).

    One run per ``output_dir``: a second one (two notebook cells, two shells) is refused while this one lives.
    On a pod slice every host runs this; host 0 holds the lock, logs and writes (``lowmem_tpu.hosts``).
    """
    import contextlib

    from lowmem_tpu.files import holding
    from lowmem_tpu.preflight import as_run_here
    from lowmem_tpu.xla.runtime import configure_environment, setup_runtime

    started = time.perf_counter()
    recipe, rehearsal = as_run_here(recipe)  # a TPU recipe on the CPU backend: its CPU equivalents
    for note in rehearsal:
        say(note)
    configure_environment(recipe.runtime)  # before transformers imports torch_xla
    if recipe.runtime.quiet:
        from lowmem_tpu.console import quiet_python_warnings

        quiet_python_warnings()  # before datasets prints its progress bars
    runtime = setup_runtime(recipe.runtime)  # on a pod slice: which host this is, and the host group
    lock = holding(Path(recipe.output_dir), "output_dir") if hosts.is_main() else contextlib.nullcontext()
    with lock:
        run = _run_training(recipe, runtime, overwrite, force_resume, started)
    hosts.leave()
    return run


def _run_training(recipe: Recipe, runtime: Any, overwrite: bool, force_resume: bool, started: float) -> TrainingRun:
    from lowmem_tpu.preflight import preflight
    from lowmem_tpu.train import checkpoint as ckpt

    # Before anything is written or loaded: what this machine must have for the run (a missing package,
    # a Hub token that cannot push, a layer class the model lacks fails now, not after training).
    summary = preflight(recipe, platform=True, reporters=True, scan="importable", hub=True, model=True)
    out = prepare_output(recipe, overwrite)
    hosts.check_shared(out)
    say(f"checking the recipe: {summary}")
    resume = ckpt.find_resume(recipe, out, force_resume)
    say("loading tokenizer and data")
    tokenizer = _tokenizer(recipe)
    train_ds, data_stats, eval_ds, prompts = _data(recipe, tokenizer, out)

    micro = micro_batch_size(recipe, runtime.num_devices)
    say(f"runtime: {runtime.describe()}, micro-batch {micro}")
    job = _build(recipe, runtime, tokenizer, train_ds, eval_ds, micro, out)
    ckpt.check_run_room(recipe, job.model, out)

    if resume and (eval_ds is not None or prompts):
        # trainer.train() loads the checkpoint only once it starts: load it now, so the evaluation
        # scores the restored model, not the untrained one (train loads the same weights again).
        job.trainer._load_from_checkpoint(str(resume))
    before = _evaluate(job, prompts, f"at resume ({resume.name})" if resume else "before training")
    say(f"training {recipe.train.max_steps} steps")
    train_started = time.perf_counter()
    result = _train(job, resume)
    train_seconds = time.perf_counter() - train_started
    if job.guard.stop_reason:
        where = getattr(job.trainer, "last_checkpoint", None)
        say(
            f"stopped at step {job.trainer.state.global_step} ({job.guard.stop_reason}); checkpoint saved in {where}. "
            "Run the same command again to resume (train.resume: auto)."
        )
        return TrainingRun(
            metrics={}, final_dir=where, trainer=job.trainer, names=job.names, stopped=job.guard.stop_reason
        )
    after = _evaluate(job, prompts, "after training")

    from lowmem_tpu.memory.record import memory_record
    from lowmem_tpu.train.report import print_summary, run_metrics

    memory = memory_record(job.plan, runtime.memory_per_device(), runtime.platform)
    metrics = run_metrics(recipe, runtime, job, data_stats, (before, after), result, train_seconds, memory)
    if metrics["compiles"]["persistent_cache"]["unreadable"]:
        say(
            f"note: the compile cache in {runtime.compile_cache_dir} could not be read back on the "
            f"{runtime.platform} backend, so everything was compiled again (on a TPU it is reused)"
        )
    final = _save(recipe, job, tokenizer, out, metrics, started)
    hosts.leave()  # the hosts' work together ends with final/; host 0 alone reports and pushes
    if not hosts.is_main():
        return TrainingRun(metrics=metrics, final_dir=final, trainer=job.trainer, names=job.names)
    from lowmem_tpu.train.plot import plot_finished_run

    say(plot_finished_run(out, final))  # final/loss.png; a failed picture is one line, never a failed run
    print_summary(metrics, final)
    if recipe.hub.push:
        from lowmem_tpu.publish.hub import push_after_training

        say(f"pushed {final} to {recipe.hub.repo_id}: {push_after_training(final, recipe)}")
    return TrainingRun(metrics=metrics, final_dir=final, trainer=job.trainer, names=job.names)


def _tokenizer(recipe: Recipe) -> Any:
    """The tokenizer, checked against the model's embedding, with the chat template the data needs."""
    from lowmem_tpu import data, model

    tokenizer = model.load_tokenizer(recipe.model)
    config = model.load_config(recipe.model, offline=True) or model.load_config(recipe.model)
    model.check_vocabulary(tokenizer, config)  # before any weight is placed
    chosen = data.set_chat_template(tokenizer, recipe.data)
    if chosen:
        say(chosen)
    return tokenizer


def _data(recipe: Recipe, tokenizer: Any, out: Path) -> tuple[Any, dict[str, Any], Any, Any]:
    """Training rows, held-out rows and exact-match prompts (tokenized once, then read from the cache)."""
    from lowmem_tpu import data
    from lowmem_tpu.data.rows import describe_cuts

    cache_dir = out / "data_cache"
    unpaired = METHODS[recipe.method].rows == "unpaired"  # KTO: labelled rows, preference pairs unpaired
    # Every host builds the same global batches (XLA keeps each host's rows): host 0 tokenizes and
    # writes the cache, the others then read it.
    several = hosts.several()
    train_ds, stats = _host_0_first(
        lambda: data.build_dataset(recipe.data, tokenizer, cache_dir=cache_dir, digest=several, unpaired=unpaired)
    )
    differs = hosts.disagreement("the training rows", stats.get("rows_sha256"))
    if differs:
        raise UserError(f"data: {differs}; every host must read the same files (a shared disk, or the same copy)")
    cached = ", from the cache" if stats["cached"] else ""
    say(
        f"data: {stats['samples']:,} samples -> {stats['rows']:,} rows of {recipe.data.max_length} tokens "
        f"({describe_cuts(stats)}, {stats['trained_tokens']:,} trained tokens"
        f"{cached})"
    )
    eval_ds = prompts = None
    if recipe.data.eval_path or recipe.data.eval_fraction:
        eval_ds, held = _host_0_first(
            lambda: data.build_dataset(recipe.data, tokenizer, role="eval", cache_dir=cache_dir, unpaired=unpaired)
        )
        say(f"held-out data: {held['samples']:,} samples -> {held['rows']:,} rows")
        if recipe.train.eval_samples:
            prompts = data.exact_match_prompts(recipe.data, tokenizer, None, recipe.train.eval_samples)
    return train_ds, stats, eval_ds, prompts


def _host_0_first(build: Any) -> Any:
    """``build()`` on host 0, then on the other hosts (which then find what host 0 cached).

    Host 0 lets the others go on even when it fails: they fail the same way rather than wait for it.
    """
    if hosts.is_main():
        try:
            return build()
        finally:
            hosts.barrier()
    hosts.barrier()
    return build()


def _train(job: Job, resume: Path | None) -> Any:
    """Run the trainer with SIGTERM and a first SIGINT turned into "save at the next step boundary, then stop"."""
    import signal
    import threading

    handled = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, job.guard.request_stop) for s in handled}
    try:
        return job.trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _build(recipe: Recipe, runtime, tokenizer, train_ds, eval_ds, micro: int, out: Path) -> Job:
    from lowmem_tpu import model as m
    from lowmem_tpu.config import parse_duration
    from lowmem_tpu.config.schema import reference_precomputed
    from lowmem_tpu.memory.record import run_plan
    from lowmem_tpu.train.guard import GuardCallback
    from lowmem_tpu.train.methods import build_method_trainer
    from lowmem_tpu.train.metrics import JsonlLog, MetricsCallback
    from lowmem_tpu.train.progress import ProgressCallback
    from lowmem_tpu.xla.sharding import place_parameters

    init = ", random init" if recipe.model.random_init else ""
    quant = f", {recipe.model.quantize} base" if recipe.model.quantize != "none" else ""
    say(f"loading {recipe.model.name_or_path} ({recipe.model.dtype}{init}{quant})")
    model = m.build_base_model(recipe.model, recipe.train.seed)
    m.check_attention(recipe, model.config)  # validate's check, for a config that was not at hand offline
    m.align_special_tokens(model, tokenizer)
    base = _base_reference(recipe, model, tokenizer, out)
    m.quantize_base(model, recipe.model)  # after saving a random-init base in full precision
    model = m.apply_lora(model, recipe)
    trainable, total = m.count_parameters(model)
    what = "LoRA" if recipe.lora.enabled else "full fine-tuning"
    say(f"{what}: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
    place_parameters(model, runtime, recipe.sharding.strategy)
    t = recipe.train
    metrics = MetricsCallback()
    wall = parse_duration(t.max_wall_time) if t.max_wall_time else None
    guard = GuardCallback(wall, t.loss_spike_factor, say, skip_nonfinite=t.on_nonfinite == "skip")
    passes = METHODS[recipe.method].forward_passes(reference_precomputed(recipe))
    flops = m.flops_per_token(
        model.config, total, trainable, recipe.data.max_length, recipe.lora.enabled, forward_passes=passes
    )
    plan = run_plan(recipe, model.config, runtime.platform, runtime.kind, runtime.num_devices)
    shown = [JsonlLog(recipe.output_dir, runtime), ProgressCallback()] if hosts.is_main() else []
    callbacks = [metrics, guard, *shown]
    trainer = build_method_trainer(
        recipe,
        runtime,
        model,
        train_ds,
        tokenizer,
        micro,
        callbacks,
        eval_dataset=eval_ds,
        flops_per_token=flops,
        planned_bytes=plan.peak if plan else None,
        base_reference=base,
    )
    return Job(
        model=model,
        names=trainer.names,
        trainer=trainer,
        metrics=metrics,
        guard=guard,
        base=base,
        trainable=trainable,
        total=total,
        micro=micro,
        runtime=runtime,
        tokenizer=tokenizer,
        flops_per_token=flops,
        plan=plan,
    )


def _base_reference(recipe: Recipe, model, tokenizer, out: Path) -> str:
    """Where the adapter's base lives; a random-init base is saved so the adapter can be reloaded."""
    from lowmem_tpu.model import resolve_source, save_tokenizer

    if not recipe.model.random_init:
        source = resolve_source(recipe.model.name_or_path)
        return str(Path(source).expanduser().resolve()) if Path(source).expanduser().exists() else source
    base = out / "base"
    if recipe.lora.enabled and hosts.is_main():  # the model is still on the host here, whole on every host
        from lowmem_tpu.preflight import preflight

        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        preflight(recipe, room=(weights + 2**20, "the random-init base saved beside the adapter"))
        model.save_pretrained(base)
        faults.point("base")
        save_tokenizer(tokenizer, base)
    return str(base.resolve())


def _evaluate(job: Job, prompts, label: str) -> dict[str, Any]:
    from lowmem_tpu.data.chat import ending
    from lowmem_tpu.infer.exact_match import greedy_exact_match
    from lowmem_tpu.xla.runtime import sync

    trainer, recipe = job.trainer, job.trainer.recipe
    result: dict[str, Any] = {}
    if trainer.eval_dataset is not None:
        scores = trainer.evaluate()
        result["loss"] = scores.get("eval_loss")
        if "eval_rewards/accuracies" in scores:  # DPO: TRL's own figures on the held-out pairs
            result["preference_accuracy"] = scores["eval_rewards/accuracies"]
            result["reward_margin"] = scores["eval_rewards/margins"]
        else:
            result["token_accuracy"] = scores.get("eval_token_accuracy")
    if prompts:
        em = greedy_exact_match(
            trainer.fsdp_model,
            job.tokenizer,
            prompts,
            ending=ending(job.tokenizer, job.model),
            length=recipe.data.max_length,
            max_new_tokens=recipe.train.max_new_tokens,
            batch_size=job.micro,
            device=job.runtime.device,
            sync=sync,
        )
        result |= {"exact_match": em.accuracy, "exact_match_total": em.total, "examples": em.examples}
    if result:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
        say(f"eval {label}: {shown}")
    return result


def _save(recipe: Recipe, job: Job, tokenizer, out: Path, metrics: dict[str, Any], started: float) -> Path:
    """Write ``final/`` on host 0; the weights' host copies are gathered on every host (a collective)."""
    from lowmem_tpu.files import fresh_partial, publish, write_json, write_manifest
    from lowmem_tpu.model import save_tokenizer
    from lowmem_tpu.publish.export import check_adapter, save_adapter, save_full_model

    final = out / "final"
    state = job.names.adapter_state() if recipe.lora.enabled else job.names.host_state()
    if hosts.is_main():
        partial = fresh_partial(final)
        if recipe.lora.enabled:
            save_adapter(job.model, state, partial, job.base)
            check_adapter(partial, sorted(state))
        else:
            save_full_model(job.model, state, partial)
        faults.point("final-weights")
        # Saved for generation: left padding, so batched prompts end where the new tokens start.
        tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
        save_tokenizer(tokenizer, partial)
        tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "right"
        (partial / "recipe.yaml").write_text(recipe.to_yaml())
        metrics["time"]["total_seconds"] = round(time.perf_counter() - started, 1)
        # Inside final/ from its first moment: a run killed once final/ exists needs nothing more from it.
        write_json(partial / "metrics.json", metrics)
        write_manifest(partial)
        faults.point("final-publish")
        publish(partial, final)
    hosts.barrier()
    say(f"saved {'adapter' if recipe.lora.enabled else 'model'} to {final}")
    return final
