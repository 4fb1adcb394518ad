"""The model card (README.md) pushed with a run: Hub metadata plus what was trained, how, and how well.

Everything comes from the files a run leaves beside its weights: ``recipe.yaml``,
``metrics.json``, ``adapter_config.json`` and, for a merged model, ``merge.json``. A missing
file only shortens the card.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowmem_tpu.config.assets import BUILTIN, looks_local
from lowmem_tpu.config.methods import METHODS, method_for_format
from lowmem_tpu.publish.export import ADAPTER_CONFIG

PROJECT = "lowmem-tpu"


def hub_id(value: str | None) -> str | None:
    """``value`` if it names a Hub repository (not a local path, not a ``builtin:`` asset)."""
    if not value or value.startswith(BUILTIN) or looks_local(value) or value.count("/") != 1:
        return None
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _sources(directory: Path) -> dict[str, dict[str, Any]]:
    from lowmem_tpu.publish.adapter_base import read_recipe_data
    from lowmem_tpu.publish.merge import MERGE_REPORT

    return {
        "recipe": read_recipe_data(directory),
        "metrics": _read_json(directory / "metrics.json"),
        "adapter": _read_json(directory / ADAPTER_CONFIG),
        "merge": _read_json(directory / MERGE_REPORT),
    }


def _base_name(src: dict[str, dict[str, Any]]) -> str | None:
    return (
        src["adapter"].get("base_model_name_or_path")
        or src["merge"].get("base")
        or src["recipe"].get("model", {}).get("name_or_path")
    )


def metadata(src: dict[str, dict[str, Any]], kind: str, license: str | None, base_model: str | None) -> str:
    """The YAML block of the card (Hub metadata)."""
    from huggingface_hub import ModelCardData

    mode = src["metrics"].get("mode") or ("lora" if kind == "adapter" or src["merge"] else "full")
    tags = [PROJECT, _run_method(src["recipe"]), "lora" if mode == "lora" else "full-fine-tuning"]
    if src["merge"]:
        tags.append("merged-lora")
    dataset = hub_id(src["recipe"].get("data", {}).get("path"))
    data = ModelCardData(
        base_model=base_model or hub_id(_base_name(src)),
        library_name="peft" if kind == "adapter" else "transformers",
        license=license or "other",
        datasets=[dataset] if dataset else None,
        tags=tags,
        pipeline_tag="text-generation",
    )
    return data.to_yaml()


def model_card(
    directory: Path,
    repo_id: str,
    kind: str,
    revision: str = "main",
    license: str | None = None,
    base_model: str | None = None,
) -> str:
    """README.md for ``directory``: YAML metadata, then training data, recipe, results, memory and usage."""
    src = _sources(directory)
    trained = {k: v for k, v in src["metrics"].items() if k != "lm_eval"}  # what training recorded
    base = base_model or hub_id(_base_name(src))
    sections = [
        f"# {repo_id.split('/')[-1]}\n\n{_summary(src, kind, base)}",
        _data_section(src["recipe"], src["metrics"]),
        _recipe_section(src["recipe"], src["metrics"]),
        _results_section(trained),
        _lm_eval_section(src["metrics"].get("lm_eval") or {}),
        _memory_section(src["recipe"], trained),
        _merge_section(src["merge"]),
        _usage_section(repo_id, kind, base, revision),
        _serving_section(directory, repo_id, kind, base),
        f"License: {license or 'not stated; the base model licence applies (pass --license to name one)'}.",
    ]
    body = "\n\n".join(s for s in sections if s)
    return f"---\n{metadata(src, kind, license, base_model)}\n---\n\n{body}\n"


def _summary(src: dict[str, dict[str, Any]], kind: str, base: str | None) -> str:
    local = f"a local base model (`{Path(_base_name(src) or '?').name}`, not on the Hub)"
    base_text = f"[`{base}`](https://huggingface.co/{base})" if base else local
    lora = src["adapter"] or src["merge"].get("lora") or {}
    targets = lora.get("target_modules")
    targets = ", ".join(sorted(targets)) if isinstance(targets, list) else targets
    quantized = (src["recipe"].get("model") or {}).get("quantize") or "none"
    method = "LoRA" if quantized == "none" else f"QLoRA ({quantized} base)"
    lora_text = f"{method} (r={lora.get('r')}, alpha={lora.get('lora_alpha')}, on {targets})"
    how = f"trained with `{PROJECT}` by {_method(src['recipe'])}"
    if kind == "adapter":
        return f"A {lora_text} adapter for {base_text}, {how}."
    if src["merge"]:
        dtype = src["merge"].get("dtype")
        text = f"{base_text} with a {lora_text} adapter merged into its weights ({dtype}), {how}."
        return text[0].upper() + text[1:]
    return f"A full fine-tune of {base_text} (every parameter trained), {how}."


def _run_method(recipe: dict[str, Any]) -> str:
    """The method a saved recipe trained with (one saved before recipes named it: from its data)."""
    return recipe.get("method") or method_for_format((recipe.get("data") or {}).get("format", "chat"))


def _method(recipe: dict[str, Any]) -> str:
    """How the weights were trained, as the card's first sentence says it."""
    name = _run_method(recipe)
    method = METHODS[name]
    if not method.preference:
        return f"supervised fine-tuning (TRL {method.trainer}, PyTorch/XLA FSDP)"
    return f"preference tuning: {_method_settings(recipe)} (TRL {method.trainer}'s loss, PyTorch/XLA FSDP)"


def _method_settings(recipe: dict[str, Any]) -> str:
    """A preference method and the settings its loss reads."""
    name, p = _run_method(recipe), recipe.get("preference") or {}
    settings = f"{name.upper()}, beta {p.get('beta', 0.1)}"
    if name == "dpo":
        settings += f", loss {'+'.join(p.get('loss_type') or ['sigmoid'])}"
    elif name == "cpo":
        settings += f", loss {(p.get('loss_type') or ['sigmoid'])[0]}"
    elif name == "simpo":
        settings += f", gamma {p.get('simpo_gamma', 0.5)}"
    return settings


def _reference(recipe: dict[str, Any]) -> str:
    """A DPO run's reference, as ``train.preference`` made it."""
    lora = (recipe.get("lora") or {}).get("enabled", True)
    precomputed = (recipe.get("preference") or {}).get("precompute_ref_log_probs")
    what = "the base model" if lora else "the starting model"
    if precomputed or (precomputed is None and not lora):
        return f"{what}, its log-probabilities computed once, before the first step"
    return f"{what} (adapters switched off), run beside the policy in every step"


def _table(rows: list[tuple[str, Any]], head: tuple[str, str] = ("", "")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows if v is not None])


def _data_section(recipe: dict[str, Any], metrics: dict[str, Any]) -> str:
    data = recipe.get("data")
    if not data:
        return ""
    lines = [f"- dataset: `{data.get('path')}` (split `{data.get('split')}`, format `{data.get('format')}`)"]
    if data.get("mask_prompt") and data.get("format") in ("alpaca", "chat"):
        lines.append("- the loss covers only the answers (prompts are masked)")
    stats = metrics.get("data") or {}
    if stats:
        lines.append(
            f"- {stats.get('samples', 0):,} samples -> {stats.get('rows', 0):,} rows of {data.get('max_length')} "
            f"tokens ({stats.get('trained_tokens', 0):,} trained tokens, {stats.get('truncated', 0)} truncated)"
        )
    if data.get("eval_path"):
        lines.append(f"- held out for evaluation: `{data['eval_path']}`")
    return "## Training data\n\n" + "\n".join(lines)


def _on(flag: Any) -> str:
    return "on" if flag else "off"


def _recipe_section(recipe: dict[str, Any], metrics: dict[str, Any]) -> str:
    if not recipe:
        return "## Recipe\n\nNo `recipe.yaml` was recorded with these weights."
    m, lora, t = recipe.get("model", {}), recipe.get("lora", {}), recipe.get("train", {})
    s, d = recipe.get("sharding", {}), recipe.get("data", {})
    lora_text = f"LoRA r={lora.get('r')}, alpha {lora.get('alpha')}, dropout {lora.get('dropout')}"
    mode = f"{lora_text}, targets {lora.get('target_modules')}" if lora.get("enabled", True) else "full fine-tuning"
    devices = f"{metrics.get('num_devices', '?')} {metrics.get('platform', '')} devices".replace("  ", " ")
    policy = s.get("activation_checkpointing")
    checkpointing = policy if isinstance(policy, str) else _on(policy)
    rows = [
        ("base model", f"`{m.get('name_or_path')}`" + (" (random init)" if m.get("random_init") else "")),
        ("training", mode),
        ("weights dtype", m.get("dtype")),
        ("steps", t.get("max_steps")),
        ("global batch", f"{t.get('global_batch_size')} (accumulation {t.get('gradient_accumulation_steps')})"),
        ("learning rate", f"{t.get('learning_rate')} {t.get('lr_scheduler')}, {t.get('warmup_steps')} warm-up steps"),
        ("optimizer", f"{t.get('optimizer')}, weight decay {t.get('weight_decay')}"),
        ("sequence length", f"{d.get('max_length')} (packing {_on(d.get('packing'))})"),
        ("sharding", f"{s.get('strategy')} over {devices}, activation checkpointing {checkpointing}"),
    ]
    command = _run_method(recipe)
    if METHODS[command].preference:
        rows.insert(2, ("method", f"{_method_settings(recipe)}: {METHODS[command].summary}"))
    if METHODS[command].reference:
        if m.get("adapter"):
            rows.insert(3, ("started from", f"`{m['adapter']}` (also the reference, frozen)"))
        else:
            rows.insert(3, ("reference", _reference(recipe)))
    rerun = f"The whole resolved recipe is in `recipe.yaml`; `{PROJECT} {command} recipe.yaml` runs it again."
    return "## Recipe\n\n" + _table(rows, ("setting", "value")) + "\n\n" + rerun


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("n/a" if value is None else str(value))


def _results_section(metrics: dict[str, Any]) -> str:
    if not metrics:
        return ""
    before, after = metrics.get("eval", {}).get("before", {}), metrics.get("eval", {}).get("after", {})
    lines = ["| metric | before | after |", "|---|---|---|"]
    named = (("loss", "eval loss"), ("token_accuracy", "eval token accuracy"), ("exact_match", "exact match"))
    named += (("preference_accuracy", "preference accuracy"), ("reward_margin", "reward margin"))
    for key, name in named:
        if key in before or key in after:
            lines.append(f"| {name} | {_fmt(before.get(key))} | {_fmt(after.get(key))} |")
    train = metrics.get("train", {})
    notes = [f"final training loss {_fmt(train.get('final_loss'))}"]
    if train.get("steady_tokens_per_second"):
        notes.append(f"{train['steady_tokens_per_second']:,.0f} tokens/s in steady state")
    if after.get("exact_match_total"):
        notes.append(f"exact match is greedy decoding on {after['exact_match_total']} held-out prompts")
    table = "\n".join(lines) + "\n\n" if len(lines) > 2 else ""
    return "## Results\n\n" + table + "; ".join(notes) + "."


def _lm_eval_section(record: dict[str, Any]) -> str:
    """lm-evaluation-harness scores (``lowmem-tpu eval DIR --tasks ...``), as lm-eval reported them."""
    lines = ["| task | score | shots | documents | chat template |", "|---|---|---|---|---|"]
    for task, entry in (record.get("tasks") or {}).items():
        scores = ", ".join(f"{name} {value:.4f}" for name, value in entry.get("scores", {}).items())
        shots = entry.get("num_fewshot")
        lines.append(
            f"| {task} | {scores} | {'default' if shots is None else shots} | {entry.get('samples') or 'n/a'} | "
            f"{'yes' if entry.get('chat_template') else 'no'} |"
        )
    if len(lines) == 2:
        return ""
    how = f"lm-evaluation-harness {record.get('lm_eval_version')} on the CPU (`lowmem-tpu eval DIR --tasks ...`)."
    return "## Benchmarks\n\n" + "\n".join(lines) + f"\n\n{how}"


def _memory_section(recipe: dict[str, Any], metrics: dict[str, Any]) -> str:
    """What the run recorded about memory; a ``memory`` mapping in metrics.json is rendered row by row."""
    if not metrics:
        return ""
    m = metrics
    trainable, total = m.get("trainable_parameters"), m.get("total_parameters")
    share = f"{trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)" if trainable and total else None
    rows = [
        ("parameters", share),
        ("weights dtype", recipe.get("model", {}).get("dtype")),
        ("sharding", recipe.get("sharding", {}).get("strategy")),
        ("devices", f"{m['num_devices']} x {m.get('platform')}" if m.get("num_devices") else None),
        (
            "micro-batch x length",
            f"{m['micro_batch_size']} x {m.get('max_length')}" if m.get("micro_batch_size") else None,
        ),
    ]
    memory = m.get("memory") if isinstance(m.get("memory"), dict) else {}
    rows += _memory_rows(memory)
    note = "" if memory.get("per_device_bytes") else "\n\nPer-device memory figures were not recorded for this run."
    return "## Memory\n\n" + _table(rows, ("quantity", "value")) + note


def _memory_rows(memory: dict[str, Any]) -> list[tuple[str, Any]]:
    """Per-device memory as recorded in metrics.json by ``lowmem-tpu sft`` (lowmem_tpu.memory.record)."""
    figures = memory.get("per_device_bytes") or {}

    def gib(key: str) -> str:
        from lowmem_tpu.console import size

        return size(figures.get(key))

    rows: list[tuple[str, Any]] = []
    if "planned_peak" in figures:
        planned = f"{gib('planned_peak')} ({gib('planned_with_margin')} with margin) of {gib('device_memory')}"
        rows.append(("planned peak per device", f"{planned}; {memory.get('planned_by')}"))
    if "measured_peak" in figures:
        rows.append(("measured peak per device", f"{gib('measured_peak')}; {memory.get('measured_by')}"))
    elif memory.get("not_measured"):
        rows.append(("measured peak per device", f"not measured: {memory['not_measured']}"))
    return rows


def _merge_section(merge: dict[str, Any]) -> str:
    check = merge.get("check")
    if not check:
        return ""
    return (
        "## Merge check\n\n"
        f"Before publishing, the merged weights were reloaded and run on {len(check.get('prompts', []))} fixed "
        f"prompts ({check.get('tokens')} tokens): {check.get('metric')} = {check.get('relative_diff', 0):.2e} "
        f"(tolerance {check.get('tolerance')}); top-1 token agreement {check.get('top1_agreement', 0):.3f}. "
        "Details in `merge.json`."
    )


def _serving_section(directory: Path, repo_id: str, kind: str, base: str | None) -> str:
    """Serving it: vLLM (an adapter vLLM's loader accepts, or the model), and llama.cpp through GGUF."""
    lines = ["## Serve it", ""]
    if kind == "adapter":
        from lowmem_tpu.publish.vllm import max_lora_rank, vllm_problems

        problems = vllm_problems(directory)
        if problems:
            lines.append(f"vLLM does not load this adapter as it is: {'; '.join(problems)}.")
        else:
            name = repo_id.split("/")[-1]
            lines += [
                "vLLM (on GPUs, and on TPUs with vllm-tpu and `MODEL_IMPL_TYPE=vllm`):",
                "",
                f"```bash\nvllm serve {base or 'PATH/TO/BASE'} --enable-lora --lora-modules {name}={repo_id} "
                f"--max-lora-rank {max_lora_rank(directory)}\n```",
            ]
    else:
        lines += ["vLLM:", "", f"```bash\nvllm serve {repo_id}\n```"]
    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    if ggufs:
        command = f"llama-cli --hf-repo {repo_id} --hf-file {ggufs[0]}"
        lines += ["", "llama.cpp (and Ollama, LM Studio):", "", f"```bash\n{command}\n```"]
    else:
        lines += [
            "",
            "llama.cpp, Ollama, LM Studio: write GGUF files with "
            f"`lowmem-tpu export {'RUN' if kind == 'adapter' else 'MODEL_DIR'} --gguf q8_0` (checked by llama.cpp "
            "itself), then `llama-cli -m FILE.gguf`.",
        ]
    return "\n".join(lines)


def _usage_section(repo_id: str, kind: str, base: str | None, revision: str) -> str:
    rev = "" if revision == "main" else f', revision="{revision}"'
    if kind == "adapter":
        where = "" if base else "# the base this adapter was trained on is not on the Hub: point to your copy\n"
        code = (
            "from peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'{where}base = AutoModelForCausalLM.from_pretrained("{base or "PATH/TO/BASE"}")\n'
            f'model = PeftModel.from_pretrained(base, "{repo_id}"{rev})\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}"{rev})\n'
        )
    else:
        code = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}"{rev})\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}"{rev})\n'
        )
    return f"## Use it\n\n```python\n{code}```"
