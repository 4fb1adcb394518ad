"""``lowmem-tpu eval DIR --tasks T1,T2``: lm-evaluation-harness's own tasks and scores on a trained model.

The model is loaded as ``generate`` loads it (an adapter on its base, quantized as it trained; or a merged or
full model) and handed to lm-eval's Hugging Face model class on the host CPU, in plain PyTorch: lm-eval's
batches change shape with every request, which under XLA would compile a program per shape. Tasks are
lm-eval's registry names (their datasets come from the Hub, or its cache), task YAML files in
``--include-path``, or ``builtin:reverse``: two tasks on the demo's held-out words, written here, offline.
Scores go into the directory's ``metrics.json`` (and so into the model card) under ``lm_eval``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError

BUILTIN = "builtin:reverse"
BUILTIN_TASKS = ("reverse_choice", "reverse_generate")
_CHOICE = """task: reverse_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "reverse {{{{word}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
_GENERATE = """task: reverse_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "reverse {{{{word}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["</s>"]
  do_sample: false
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks: name at least one lm-eval task (e.g. --tasks builtin:reverse or hellaswag)")
    return [name for t in tasks for name in (BUILTIN_TASKS if t == BUILTIN else (t,))]


def write_builtin_tasks(directory: Path) -> Path:
    """The demo's held-out words as two lm-eval tasks (multiple choice, and greedy generation)."""
    from lowmem_tpu.config.assets import resolve_builtin

    docs = []
    for line in resolve_builtin("builtin:reverse/eval.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        word = messages[0]["content"].removeprefix("reverse ")
        answer = messages[1]["content"]
        docs.append({"word": word, "answer": answer, "choices": [answer, word, answer[1:] + answer[0]]})
    data = directory / "reverse.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (directory / "reverse_choice.yaml").write_text(_CHOICE.format(data=data))
    (directory / "reverse_generate.yaml").write_text(_GENERATE.format(data=data))
    return directory


def run_tasks(
    directory: Path,
    tasks: list[str],
    *,
    include_path: Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    chat_template: bool | None = None,
) -> dict[str, Any]:
    """lm-eval's results for ``tasks`` on the model in ``directory``; also written into its metrics.json."""
    from lowmem_tpu.console import say
    from lowmem_tpu.infer.load import kind_of, load_trained
    from lowmem_tpu.publish.merge import cpu_only

    kind_of(Path(directory))
    if not os.access(directory, os.W_OK):
        raise UserError(f"{directory} is not writable: the scores go into its metrics.json; evaluate a copy")
    cpu_only()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lowmem-lm-eval-") as scratch:
        paths = [str(write_builtin_tasks(Path(scratch)))] + ([str(include_path)] if include_path else [])
        manager = _task_manager(paths, tasks)
        trained = load_trained(Path(directory))
        use_chat = _use_chat(trained, chat_template)
        say(f"lm-eval on the CPU: {', '.join(tasks)}{' (chat template)' if use_chat else ''}")
        results = _evaluate(trained, tasks, manager, limit, num_fewshot, batch_size, use_chat)
    import lm_eval

    settings = {"num_fewshot": num_fewshot, "limit": limit, "chat_template": use_chat}
    samples = results.get("n-samples", {})
    record = {
        "lm_eval_version": lm_eval.__version__,
        "device": "cpu",
        "seconds": round(time.perf_counter() - started, 1),
        "tasks": {  # every task lm-eval scored: a group's subtasks and the group itself
            task: {"scores": _scores(metrics), "samples": samples.get(task, {}).get("effective"), **settings}
            for task, metrics in results["results"].items()
        },
    }
    _record(Path(directory), record)
    return record


def _task_manager(paths: list[str], tasks: list[str]) -> Any:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"--tasks: lm-eval knows no task {', '.join(unknown)}; give a registry name (lm-eval ls tasks), "
            f"{BUILTIN}, or the folder of your task YAML with --include-path"
        )
    return manager


def _use_chat(trained: Any, asked: bool | None) -> bool:
    """As the run trained: chat-formatted data gets the chat template (unless asked otherwise)."""
    has = bool(getattr(trained.tokenizer, "chat_template", None))
    if asked and not has:
        raise UserError("--chat-template: this model's tokenizer has no chat template")
    return has and (asked if asked is not None else trained.data_format in ("chat", "sharegpt"))


def _evaluate(trained, tasks, manager, limit, num_fewshot, batch_size, use_chat) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=trained.model, tokenizer=trained.tokenizer, batch_size=batch_size, device="cpu")
    try:
        results = simple_evaluate(
            model=model,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            apply_chat_template=use_chat,
            log_samples=False,
            bootstrap_iters=0,
        )
    except (ConnectionError, OSError) as err:
        raise UserError(
            f"lm-eval could not load a task's data ({type(err).__name__}: {err}); tasks from the Hub need the "
            "network or lm-eval's cache; local task files (--include-path) work offline"
        ) from None
    if results is None:
        raise UserError("lm-eval returned no results; run eval --tasks in one process, on one host")
    return results


def _scores(metrics: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``"acc,none"`` keys as ``acc``; its alias, sample count and stderr placeholders left out."""
    out = {}
    for key, value in metrics.items():
        name = key.split(",")[0]
        if isinstance(value, int | float) and not name.endswith("_stderr") and name != "sample_len":
            out[name] = float(value)
    return out


def _record(directory: Path, record: dict[str, Any]) -> None:
    """Into metrics.json beside the scores of earlier tasks (a task run again is replaced), keeping the
    directory whole: its manifest is rewritten when it has one (both written beside and renamed in)."""
    from lowmem_tpu.files import MANIFEST, write_json, write_manifest

    path = directory / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    earlier = (metrics.get("lm_eval") or {}).get("tasks") or {}
    metrics["lm_eval"] = {key: record[key] for key in ("lm_eval_version", "device")}
    metrics["lm_eval"]["tasks"] = {**earlier, **record["tasks"]}
    write_json(path, metrics)
    if (directory / MANIFEST).is_file():
        write_manifest(directory)


def format_results(directory: Path, record: dict[str, Any]) -> str:
    lines = [f"lm-eval {record['lm_eval_version']} on {directory} (CPU, {record['seconds']:.0f} s):"]
    for task, entry in record["tasks"].items():
        shown = ", ".join(f"{name} {value:.4f}" for name, value in entry["scores"].items()) or "no score"
        lines.append(f"  {task}: {shown}" + (f" ({entry['samples']} samples)" if entry["samples"] else ""))
    lines.append(f"written to {directory / 'metrics.json'} (lm_eval)")
    return "\n".join(lines)
