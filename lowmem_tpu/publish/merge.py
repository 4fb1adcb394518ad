"""Merging a LoRA adapter into its base, on the CPU, and proving the result equals base + adapter.

Memory: the base is loaded once and the adapter is merged into it in place (PEFT's safe
merge copies one layer at a time), so the process holds one copy of the weights plus, while
saving, one safetensors shard. The check reloads the written directory only after that copy
is freed, so it tests the files a user will load, not the objects in memory.

Every cheap check (adapter files, ``--out``, the recorded base, shapes on a ``meta`` model) runs before
any weights are loaded.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lowmem_tpu.errors import UserError
from lowmem_tpu.files import check_whole, checkpoint_instead, fresh_partial, publish, write_json, write_manifest
from lowmem_tpu.publish.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lowmem_tpu.publish.verify import TOLERANCE, compare, logits, prompt_ids

MERGE_REPORT = "merge.json"
PROVENANCE = ("recipe.yaml", "metrics.json")  # copied beside the merged weights
LORA_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class BaseChoice:
    """The base model the adapter is merged into, and whether it is the one the adapter records."""

    source: str
    revision: str | None
    recorded: str
    recorded_revision: str | None
    forced: bool


@dataclass(frozen=True)
class MergeResult:
    """What ``merge_adapter`` wrote: the directory, its files with sizes, and the equivalence check."""

    out: Path
    files: dict[str, int]
    check: dict[str, Any]


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The adapter's config, after checking that the directory holds a LoRA adapter."""
    if not adapter_dir.is_dir():
        raise UserError(f"{adapter_dir}: no such directory; give output_dir/final of a LoRA run")
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter_dir / name).is_file()]
    if missing and (err := checkpoint_instead(adapter_dir)):
        raise err
    check_whole(adapter_dir)
    if missing and (adapter_dir / "config.json").is_file() and not (adapter_dir / ADAPTER_CONFIG).exists():
        raise UserError(
            f"{adapter_dir} holds a full model, not a LoRA adapter: there is nothing to merge "
            "(push or load it as it is)"
        )
    if missing:
        raise UserError(
            f"{adapter_dir} is not a complete LoRA adapter: missing {', '.join(missing)}; "
            "give output_dir/final of a LoRA run (lora.enabled: true)"
        )
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG}: not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA" or not config.get("base_model_name_or_path"):
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG}: not a LoRA adapter config naming its base model")
    return config


def read_recipe_data(directory: Path) -> dict[str, Any]:
    """The resolved ``recipe.yaml`` of a run as plain data ({} if absent).

    Not validated: a recipe written on a TPU VM names files that need not exist here.
    """
    path = directory / "recipe.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def _same_source(a: str, b: str) -> bool:
    from lowmem_tpu.model import resolve_source

    pa, pb = Path(resolve_source(a)).expanduser(), Path(resolve_source(b)).expanduser()
    if pa.exists() or pb.exists():
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def choose_base(
    config: dict[str, Any], adapter_dir: Path, base: str | None, revision: str | None, force: bool
) -> BaseChoice:
    """The base to merge into: the recorded one, or ``base``/``revision`` (refused when they differ, unless forced)."""
    recorded = config["base_model_name_or_path"]
    recorded_revision = config.get("revision") or read_recipe_data(adapter_dir).get("model", {}).get("revision")
    source = base or recorded
    chosen_revision = revision or (recorded_revision if base is None or _same_source(base, recorded) else None)
    problems = []
    if not _same_source(source, recorded):
        problems.append(f"--base {source} is not the base the adapter was trained on ({recorded})")
    if (chosen_revision or "main") != (recorded_revision or "main"):
        problems.append(
            f"--revision {chosen_revision or 'main'} is not the revision the adapter was trained on "
            f"({recorded_revision or 'main'})"
        )
    if problems and not force:
        raise UserError(
            [*problems, "pass --force if you are sure it is the same model (for example a moved copy)"]
            if len(problems) > 1
            else f"{problems[0]}; pass --force if you are sure it is the same model (for example a moved copy)"
        )
    if base is None and _looks_missing_path(recorded):
        raise UserError(
            f"the adapter's base {recorded} does not exist on this machine; "
            "pass --base PATH_OR_ID (with --force, since it differs from the recorded one)"
        )
    return BaseChoice(source, chosen_revision, recorded, recorded_revision, bool(problems))


def _looks_missing_path(source: str) -> bool:
    from lowmem_tpu.config.assets import looks_local

    return looks_local(source) and not Path(source).expanduser().exists()


def check_out_dir(out: Path, protected: list[Path], force: bool) -> None:
    """Refuse an ``--out`` that holds something (unless forced) or that would overwrite the inputs."""
    from lowmem_tpu.files import LOCK  # a lock file alone (ours, or a killed merge's) is no content

    target = out.expanduser().resolve()
    for path in protected:
        p = path.expanduser().resolve()
        if target == p or target in p.parents or p in target.parents:
            raise UserError(f"--out {out} overlaps {path}, which the merge reads; choose a separate directory")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(p.name != LOCK for p in out.iterdir()) and not force:
        raise UserError(f"--out {out} exists and is not empty; choose another directory or pass --force to replace it")


def check_adapter_tensors(adapter_dir: Path, base_config: Any) -> None:
    """Every LoRA tensor is finite and fits its base module; problems name the module and both shapes.

    Runs on a ``meta`` model (no weights), so a wrong base is refused before gigabytes are loaded.
    """
    import torch
    from safetensors.torch import load_file

    from lowmem_tpu.model import meta_model

    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    bad = [key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise UserError(
            f"{adapter_dir / ADAPTER_WEIGHTS}: {len(bad)} tensor(s) hold NaN or Inf (first: {bad[0]}); "
            "the adapter is broken (retrain, e.g. with a lower train.learning_rate)"
        )
    model = meta_model(base_config)
    modules = dict(model.named_modules())
    problems = []
    for name in sorted({_module_name(key) for key in tensors if key.endswith(LORA_SUFFIXES)}):
        a, b = tensors.get(f"{LORA_PREFIX}{name}.lora_A.weight"), tensors.get(f"{LORA_PREFIX}{name}.lora_B.weight")
        module = modules.get(name)
        if module is None or not hasattr(module, "weight"):
            problems.append(f"{name}: the adapter has LoRA weights for it, the base has no such layer")
        elif a is not None and b is not None and (b.shape[0], a.shape[1]) != tuple(module.weight.shape):
            problems.append(
                f"{name}: the adapter expects a base weight of shape {(b.shape[0], a.shape[1])} "
                f"(lora_B {tuple(b.shape)} x lora_A {tuple(a.shape)}), the base has {tuple(module.weight.shape)}"
            )
    if problems:
        more = [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
        raise UserError(
            ["the base does not match the adapter (was it trained on another model?):", *problems[:10], *more]
        )


def _module_name(key: str) -> str:
    key = key.removeprefix(LORA_PREFIX)
    for suffix in LORA_SUFFIXES:
        key = key.removesuffix(suffix)
    return key


def _load_base_config(choice: BaseChoice) -> Any:
    from transformers import AutoConfig

    from lowmem_tpu.model import resolve_source

    try:
        return AutoConfig.from_pretrained(resolve_source(choice.source), revision=choice.revision)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the config of the base {choice.source!r}: {err}") from None


def _load_causal_lm(source: str, revision: str | None, dtype: str | None) -> Any:
    """The model at ``source`` on the CPU, built as training builds its base (``dtype`` None: its own)."""
    from safetensors import SafetensorError

    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import build_base_model, load_config

    try:
        section = ModelSection(name_or_path=source, revision=revision, dtype=dtype or "float32")
        if dtype is None:
            own = getattr(load_config(section), "dtype", None)
            section = section.model_copy(update={"dtype": "float32" if str(own).endswith("float32") else "bfloat16"})
        model = build_base_model(section)
    except UserError as err:
        raise UserError(f"cannot load the model {source!r}: {err}") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise UserError(f"cannot load the model {source!r}: {type(err).__name__}: {err}") from None
    return model.eval()


def adapter_tokenizer(adapter_dir: Path, choice: BaseChoice) -> Any:
    """The tokenizer saved with the adapter (its chat template included), else the base's."""
    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import load_tokenizer

    model = read_recipe_data(adapter_dir).get("model", {})
    own = (adapter_dir / "tokenizer_config.json").is_file()
    section = ModelSection(
        name_or_path=choice.source,
        revision=None if own else choice.revision,
        tokenizer=str(adapter_dir) if own else None,
        use_fast_tokenizer=model.get("use_fast_tokenizer", True),
        pad_token=model.get("pad_token"),
    )
    return load_tokenizer(section)


def merge_adapter(
    adapter_dir: Path,
    out: Path,
    base: str | None = None,
    revision: str | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    max_shard_size: str = "2GB",
) -> MergeResult:
    """Merge a LoRA adapter into its base and write a directory ``from_pretrained`` loads.

    The result is reloaded from disk and its logits on :data:`PROMPTS` compared with base +
    adapter before anything appears in ``out`` (written beside it, then renamed).
    """
    if dtype not in TOLERANCE:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(TOLERANCE)}")
    adapter_dir, out = Path(adapter_dir), Path(out)
    config = read_adapter_config(adapter_dir)
    choice = choose_base(config, adapter_dir, base, revision, force)
    protected = [adapter_dir] + ([Path(choice.source)] if Path(choice.source).expanduser().exists() else [])
    from lowmem_tpu.files import holding_output

    with holding_output(out, "--out"):  # one writer per directory; none into a live run's output_dir
        return _merge_checked(adapter_dir, out, config, choice, protected, dtype, force, max_shard_size)


def _merge_checked(adapter_dir, out, config, choice, protected, dtype, force, max_shard_size) -> MergeResult:
    check_out_dir(out, protected, force)
    started = time.perf_counter()

    _cpu_only()
    from lowmem_tpu.console import say

    check_adapter_tensors(adapter_dir, _load_base_config(choice))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = fresh_partial(out.parent / f".{out.name}", ".merge-partial")
    try:
        say(f"loading base {choice.source} ({dtype}) on the CPU")
        tokenizer = adapter_tokenizer(adapter_dir, choice)
        rows = prompt_ids(tokenizer)
        reference = _merge_into(adapter_dir, choice, dtype, rows, partial, max_shard_size)
        gc.collect()  # model objects hold reference cycles: free the merged copy before loading the written one
        say("reloading the merged model from disk to check it")
        check = compare(reference, logits(_load_causal_lm(str(partial), None, dtype), rows), dtype)
        gc.collect()
        if not check["passed"]:
            raise UserError(
                f"the merged model's logits differ from base + adapter by {check['relative_diff']:.2e} "
                f"(relative), above the tolerance {check['tolerance']:.0e}; nothing was written "
                "(try --dtype float32)"
            )
        from lowmem_tpu.model import save_tokenizer

        save_tokenizer(tokenizer, partial)  # with the base's tokenizer.model: a drop-in for the base
        for name in PROVENANCE:
            if (adapter_dir / name).is_file():
                shutil.copy2(adapter_dir / name, partial / name)
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir())}
        write_json(partial / MERGE_REPORT, _report(adapter_dir, config, choice, dtype, files, check, started))
        files[MERGE_REPORT] = (partial / MERGE_REPORT).stat().st_size
        write_manifest(partial)
        publish(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    say(f"merged model written to {out}: logits match base + adapter within {check['relative_diff']:.1e}")
    return MergeResult(out, files, check)


def _cpu_only() -> None:
    """Merging and load checks run on the host CPU. transformers imports torch_xla: in a process of
    its own, keep it off the TPU (in a training process the runtime has already chosen)."""
    from lowmem_tpu.console import quiet_python_warnings

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    quiet_python_warnings()


def _merge_into(
    adapter_dir: Path, choice: BaseChoice, dtype: str, rows: list[Any], partial: Path, max_shard_size: str
) -> list[Any]:
    """Load base + adapter, record reference logits, merge in place, save; return the reference logits.

    Everything big is local to this function, so it is freed when it returns.
    """
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load_causal_lm(choice.source, choice.revision, dtype), str(adapter_dir))
    model.eval()
    reference = logits(model, rows)
    try:
        merged = model.merge_and_unload(safe_merge=True)  # in place; refuses NaN/Inf per layer
    except ValueError as err:
        raise UserError(f"the merge produced non-finite weights ({err}); nothing was written") from None
    merged.config.use_cache = True  # training turned the KV cache off; a served model wants it
    merged.save_pretrained(partial, max_shard_size=max_shard_size)
    return reference


def _report(adapter_dir, config, choice, dtype, files, check, started) -> dict[str, Any]:
    return {
        "adapter": str(adapter_dir.resolve()),
        "base": choice.source,
        "base_revision": choice.revision,
        "recorded_base": choice.recorded,
        "recorded_revision": choice.recorded_revision,
        "forced_base": choice.forced,
        "dtype": dtype,
        "lora": {key: config.get(key) for key in ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")},
        "files": files,
        "check": check,
        "seconds": round(time.perf_counter() - started, 1),
    }


def verify_loads(directory: Path, kind: str) -> str:
    """Load an adapter onto its recorded base, or a model directory, on the CPU; one forward pass must be finite.

    Returns a one-line description; raises UserError when the directory does not load.
    """
    _cpu_only()
    import torch

    if kind == "adapter":
        config = read_adapter_config(directory)
        if _looks_missing_path(config["base_model_name_or_path"]):
            raise UserError(
                f"cannot check that {directory} loads: its base, {config['base_model_name_or_path']}, is not on "
                "this machine; push from where the base is (or restore it at that path)"
            )
        choice = choose_base(config, directory, None, None, force=False)
        check_adapter_tensors(directory, _load_base_config(choice))
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(_load_causal_lm(choice.source, choice.revision, None), str(directory))
        except (RuntimeError, ValueError) as err:
            raise UserError(f"{directory} does not load onto {choice.source}: {err}") from None
        what = f"the adapter loads onto {choice.source}"
    else:
        model = _load_causal_lm(str(directory), None, None)
        what = f"{directory} loads with AutoModelForCausalLM"
    vocab = model.get_input_embeddings().weight.shape[0]
    out = logits(model.eval(), [torch.arange(min(8, vocab)).unsqueeze(0)])[0]
    if not torch.isfinite(out).all():
        raise UserError(f"{directory} loads but its logits hold NaN or Inf; it was not pushed")
    params = sum(p.numel() for p in model.parameters())
    return f"checked: {what} ({params:,} parameters, finite logits)"
