"""``lowmem-tpu eval``: score a trained model on a data set, by the very code ``sft`` scores with.

Held-out loss and token accuracy come from the run's own trainer (``XlaSFTTrainer.evaluate`` on
rows tokenized by ``data.build_dataset``; a DPO run's: TRL's loss, preference accuracy and reward margin
against the base), greedy exact match from ``infer.exact_match.greedy_exact_match``
on the prompts ``data.exact_match_prompts`` builds: the numbers ``sft`` prints before and after
training, for any adapter or model directory and any data in its run's format.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError

DEFAULT_SAMPLES = 100


def _recipe(
    saved: dict[str, Any], directory: Path, data: str, fmt: str | None, split: str | None, out: str, method: str | None
) -> Any:
    """The run's recipe, pointed at ``data`` as its held-out set (nothing is trained), as this machine runs it
    (a TPU-only setting on the CPU backend: its equivalent, ``preflight.as_run_here``)."""
    from lowmem_tpu.config import with_overrides
    from lowmem_tpu.preflight import as_run_here

    if not saved:
        raise UserError(f"{directory}: no recipe.yaml beside the weights; eval needs the run's data settings")
    overrides = [f"data.path={data}", "data.eval_path=null", "data.eval_fraction=0", f"output_dir={out}"]
    overrides += ["train.eval_samples=0", "train.eval_steps=null", "hub.push=false", "data.max_samples=null"]
    overrides += ["runtime.device=auto"]  # where eval runs: the TPU here, else the CPU backend
    overrides += [f"data.format={fmt}"] if fmt else []
    overrides += [f"data.split={split}"] if split else []
    overrides += [f"method={method or scored_method(saved, fmt)}"]
    if method and method != saved.get("method"):  # another method's loss: its own defaults, the run's beta
        saved = {**saved, "preference": {"beta": (saved.get("preference") or {}).get("beta", 0.1)}}
    return as_run_here(with_overrides(saved, overrides))[0]


def scored_method(saved: dict[str, Any], fmt: str | None) -> str:
    """The method whose loss eval reports: the run's own, unless ``fmt`` asks for data it does not read
    (an SFT model scored on preference pairs: DPO's, against its base)."""
    from lowmem_tpu.config.methods import METHODS, method_for_format

    method = saved.get("method") or method_for_format((saved.get("data") or {}).get("format", "chat"))
    return method if fmt is None or fmt in METHODS[method].formats else method_for_format(fmt)


def evaluate_directory(
    directory: Path,
    data: str,
    *,
    fmt: str | None = None,
    split: str | None = None,
    samples: int | None = None,
    method: str | None = None,
) -> dict[str, Any]:
    """Loss, perplexity, token accuracy and greedy exact match of the model in ``directory`` on ``data``."""
    from lowmem_tpu import data as d
    from lowmem_tpu.config.methods import METHODS
    from lowmem_tpu.console import say
    from lowmem_tpu.data.formats import require_columns
    from lowmem_tpu.infer.load import kind_of, load_trained
    from lowmem_tpu.publish.adapter_base import read_recipe_data
    from lowmem_tpu.xla import runtime as rt

    kind = kind_of(Path(directory))
    saved = read_recipe_data(Path(directory))
    _check_preference(saved, kind, directory, fmt, method)
    n = samples if samples is not None else (saved.get("train", {}).get("eval_samples") or DEFAULT_SAMPLES)
    with tempfile.TemporaryDirectory(prefix="lowmem-eval-") as out:
        recipe = _recipe(saved, Path(directory), data, fmt, split, out, method)
        records, source = d.select_records(recipe.data, "eval", path=data)
        require_columns(records, recipe.data, source)  # data in the wrong format fails before any weights load
        from lowmem_tpu.config import RuntimeSection, micro_batch_size

        runtime = rt.setup_runtime(RuntimeSection(device="auto", num_cpu_devices=recipe.runtime.num_cpu_devices))
        trained = load_trained(Path(directory))
        micro = micro_batch_size(recipe, runtime.num_devices)
        unpaired = METHODS[recipe.method].rows == "unpaired"
        rows, stats = d.build_dataset(recipe.data, trained.tokenizer, role="eval", path=data, unpaired=unpaired)
        with_answers = recipe.data.format != "text" and n > 0
        prompts = d.exact_match_prompts(recipe.data, trained.tokenizer, data, n) if with_answers else []
        say(f"{data}: {stats['samples']:,} samples -> {stats['rows']:,} rows; {len(prompts)} exact-match prompts")
        return _score(recipe, runtime, trained, rows, prompts, micro) | {"data": data, "rows": stats["rows"]}


def _check_preference(saved: dict[str, Any], kind: str, directory: Path, fmt: str | None, method: str | None) -> None:
    """A DPO run is scored against its reference: the base under its adapters, or the adapter it started from
    (``model.adapter``). Refused, before any weight loads, where that reference is not there to be had."""
    from lowmem_tpu.config.methods import METHODS

    if method not in (None, *METHODS):
        raise UserError(f"eval --method: {method!r} is not a method; the methods: {', '.join(METHODS)}")
    if not METHODS[method or scored_method(saved, fmt)].reference:
        return
    started_from = saved.get("model", {}).get("adapter")
    if kind != "adapter" and saved.get("lora", {}).get("enabled") is False:
        return  # full-parameter DPO: its reference is the run's starting model, loaded again (``_reference_rows``)
    if kind != "adapter":
        raise UserError(
            f"{directory} is a merged model: preference scores compare it with its reference, the base under the "
            "adapters, which merging removed; evaluate the run's adapter directory (final/) instead"
        )
    if started_from and not (Path(started_from).expanduser() / "adapter_model.safetensors").is_file():
        raise UserError(
            f"this DPO run started from the adapter {started_from}, its reference, which is not there: restore it "
            "at that path, or score the run's held-out pairs from its own metrics.json"
        )


def _score(recipe: Any, runtime: Any, trained: Any, rows: Any, prompts: list, micro: int) -> dict[str, Any]:
    from lowmem_tpu.config.methods import METHODS
    from lowmem_tpu.data.chat import ending
    from lowmem_tpu.infer.exact_match import greedy_exact_match
    from lowmem_tpu.train.methods import build_method_trainer
    from lowmem_tpu.xla.runtime import sync
    from lowmem_tpu.xla.sharding import place_parameters

    model, tokenizer = trained.model, trained.tokenizer
    method = METHODS[recipe.method]
    pairs, reference = method.preference, method.reference
    if reference and not recipe.lora.enabled:  # before the trained model is placed: one model on the devices
        rows = _reference_rows(recipe, runtime, rows, tokenizer, micro)
    place_parameters(model, runtime, recipe.sharding.strategy)
    trainer = build_method_trainer(recipe, runtime, model, rows, tokenizer, micro, [], eval_dataset=rows)
    if reference and recipe.model.adapter:  # the reference: the adapter the run started from, not TRL's copy of it
        from lowmem_tpu.train.preference import load_reference

        load_reference(trainer.policy, Path(recipe.model.adapter).expanduser())
    scores = trainer.evaluate()
    loss = scores.get("eval_loss")
    result: dict[str, Any] = {"loss": loss, "perplexity": math.exp(loss) if loss is not None and loss < 50 else None}
    if pairs:  # TRL's own figures: a preference loss is no language-model loss (no perplexity)
        result |= {
            "perplexity": None,
            "preference_accuracy": scores.get("eval_rewards/accuracies"),
            "reward_margin": scores.get("eval_rewards/margins"),
        }
    else:
        result["token_accuracy"] = scores.get("eval_token_accuracy")
    if prompts:
        em = greedy_exact_match(
            trainer.fsdp_model,
            tokenizer,
            prompts,
            ending=ending(tokenizer, model),
            length=recipe.data.max_length,
            max_new_tokens=recipe.train.max_new_tokens,
            batch_size=micro,
            device=runtime.device,
            sync=sync,
        )
        result |= {"exact_match": em.accuracy, "exact_match_total": em.total, "examples": em.examples}
    return result


def _reference_rows(recipe: Any, runtime: Any, rows: Any, tokenizer: Any, micro: int) -> Any:
    """A full-parameter DPO run's pairs with its reference's log-probabilities: those of the model the run
    started from (``model.name_or_path``, or its random init from the run's seed), loaded and freed first."""
    import gc

    from lowmem_tpu import model as m
    from lowmem_tpu.console import say
    from lowmem_tpu.train.methods import build_method_trainer
    from lowmem_tpu.xla.sharding import place_parameters

    say(f"the reference: {recipe.model.name_or_path}, the model this full-parameter DPO run started from")
    base = m.build_base_model(recipe.model, recipe.train.seed)
    m.align_special_tokens(base, tokenizer)
    place_parameters(base, runtime, recipe.sharding.strategy)
    trainer = build_method_trainer(recipe, runtime, base, rows, tokenizer, micro, [], eval_dataset=rows)
    rows = trainer._with_reference(rows, "eval")
    del trainer, base
    gc.collect()
    return rows


def format_scores(directory: Path, result: dict[str, Any]) -> str:
    """The human summary of :func:`evaluate_directory`."""
    lines = [f"{directory} on {result['data']} ({result['rows']:,} rows)"]
    if result.get("loss") is None:
        lines.append("  loss            n/a: fewer rows than one batch (a partial batch is dropped: static shapes)")
    labels = [("loss", "loss"), ("perplexity", "perplexity"), ("token_accuracy", "token accuracy")]
    labels += [("preference_accuracy", "preference acc"), ("reward_margin", "reward margin")]
    for key, label in labels:
        if result.get(key) is not None:
            lines.append(f"  {label:<16}{result[key]:.4f}")
    if "exact_match" in result:
        lines.append(
            f"  {'exact match':<16}{result['exact_match']:.4f} ({result['exact_match_total']} prompts, greedy)"
        )
        for prompt, expected, got in result["examples"]:
            mark = "ok" if got.strip() == expected.strip() else "XX"
            lines.append(f"    [{mark}] {prompt.strip()[-60:]!r} -> {got!r} (expected {expected!r})")
    return "\n".join(lines)
