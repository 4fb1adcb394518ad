"""Merging a LoRA adapter into its base, on the CPU, and proving the result equals base + adapter.

Memory: the base is loaded once and the adapter is merged into it in place (PEFT's safe
merge copies one layer at a time), so the process holds one copy of the weights plus, while
saving, one safetensors shard. The check reloads the written directory only after that copy
is freed, so it tests the files a user will load, not the objects in memory.

Every cheap check (adapter files, ``--out``, the recorded base, shapes on a ``meta`` model) runs before
any weights are loaded.

A run on a quantized base (QLoRA) trained its adapters against the dequantized weights, and ``generate``
and ``eval`` run them there too. By default the adapters are merged into those dequantized weights (the
model that was trained and evaluated: its logits are checked against the quantized base + adapter);
``original_weights`` merges into the full-precision checkpoint instead (checked against it + adapter), a
model the adapters were not trained on, which differs from the trained one by the quantization error.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError
from lowmem_tpu.files import fresh_partial, publish, write_json, write_manifest
from lowmem_tpu.publish.adapter_base import (
    BaseChoice,
    adapter_tokenizer,
    check_adapter_tensors,
    choose_base,
    load_base_config,
    load_causal_lm,
    looks_missing_path,
    read_adapter_config,
    trained_quantization,
)
from lowmem_tpu.publish.verify import TOLERANCE, compare, logits, prompt_ids

MERGE_REPORT = "merge.json"
PROVENANCE = ("recipe.yaml", "metrics.json")  # copied beside the merged weights


@dataclass(frozen=True)
class MergeResult:
    """What ``merge_adapter`` wrote: the directory, its files with sizes, and the equivalence check."""

    out: Path
    files: dict[str, int]
    check: dict[str, Any]


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


def merge_adapter(
    adapter_dir: Path,
    out: Path,
    base: str | None = None,
    revision: str | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    max_shard_size: str = "2GB",
    original_weights: bool = False,
) -> MergeResult:
    """Merge a LoRA adapter into its base and write a directory ``from_pretrained`` loads.

    The result is reloaded from disk and its logits on :data:`PROMPTS` compared with base +
    adapter before anything appears in ``out`` (written beside it, then renamed). A quantized run's
    adapters go into the dequantized weights they trained on, unless ``original_weights``.
    """
    if dtype not in TOLERANCE:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(TOLERANCE)}")
    adapter_dir, out = Path(adapter_dir), Path(out)
    config = read_adapter_config(adapter_dir)
    choice = choose_base(config, adapter_dir, base, revision, force)
    protected = [adapter_dir] + ([Path(choice.source)] if Path(choice.source).expanduser().exists() else [])
    from lowmem_tpu.files import holding_output

    with holding_output(out, "--out"):  # one writer per directory; none into a live run's output_dir
        quantized = None if original_weights else trained_quantization(adapter_dir)
        return _merge_checked(adapter_dir, out, config, choice, protected, dtype, force, max_shard_size, quantized)


def _merge_checked(adapter_dir, out, config, choice, protected, dtype, force, max_shard_size, quantized) -> MergeResult:
    check_out_dir(out, protected, force)
    started = time.perf_counter()

    cpu_only()
    from lowmem_tpu.console import say

    check_adapter_tensors(adapter_dir, load_base_config(choice))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = fresh_partial(out.parent / f".{out.name}", ".merge-partial")
    try:
        as_trained = f", {quantized['quantize']} dequantized as trained" if quantized else ""
        say(f"loading base {choice.source} ({dtype}{as_trained}) on the CPU")
        tokenizer = adapter_tokenizer(adapter_dir, choice)
        rows = prompt_ids(tokenizer)
        reference = _merge_into(adapter_dir, choice, dtype, rows, partial, max_shard_size, quantized)
        gc.collect()  # model objects hold reference cycles: free the merged copy before loading the written one
        say("reloading the merged model from disk to check it")
        # A base trained in bfloat16 and merged in float32 is as exact as bfloat16 arithmetic was.
        tolerance = max((dtype, (quantized or {}).get("dtype", dtype)), key=lambda d: TOLERANCE.get(d, 0))
        check = compare(reference, logits(load_causal_lm(str(partial), None, dtype), rows), tolerance)
        check["against"] = f"{quantized['quantize']} base + adapter" if quantized else "base + adapter"
        gc.collect()
        if not check["passed"]:
            raise UserError(
                f"the merged model's logits differ from {check['against']} by {check['relative_diff']:.2e} "
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
    say(f"merged model written to {out}: logits match {check['against']} within {check['relative_diff']:.1e}")
    return MergeResult(out, files, check)


def cpu_only() -> None:
    """Merging and load checks run on the host CPU. transformers imports torch_xla: in a process of
    its own, keep it off the TPU (in a training process the runtime has already chosen)."""
    from lowmem_tpu.console import quiet_python_warnings

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    quiet_python_warnings()


def _merge_into(
    adapter_dir: Path,
    choice: BaseChoice,
    dtype: str,
    rows: list[Any],
    partial: Path,
    max_shard_size: str,
    quantized: dict[str, Any] | None,
) -> list[Any]:
    """Load base + adapter, record reference logits, merge in place, save; return the reference logits.

    A quantized base is built as the run trained it; after the reference logits (the quantized base +
    adapter, as ``generate`` computes them) its layers become linears holding the dequantized weights,
    in ``dtype``, and the adapters merge into those. Everything big is local to this function, so it is
    freed when it returns.
    """
    from peft import PeftModel

    base = load_causal_lm(choice.source, choice.revision, dtype, quantized)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    reference = logits(model, rows)
    if quantized:
        from lowmem_tpu.model import torch_dtype
        from lowmem_tpu.model.quantize import dequantize_model

        dequantize_model(model, torch_dtype(dtype))
        model.to(torch_dtype(dtype))
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
        "merged_into": check["against"].removesuffix(" + adapter"),
        "lora": {key: config.get(key) for key in ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")},
        "files": files,
        "check": check,
        "seconds": round(time.perf_counter() - started, 1),
    }


def verify_loads(directory: Path, kind: str) -> str:
    """Load an adapter onto its recorded base, or a model directory, on the CPU; one forward pass must be finite.

    Returns a one-line description; raises UserError when the directory does not load.
    """
    cpu_only()
    import torch

    if kind == "adapter":
        config = read_adapter_config(directory)
        if looks_missing_path(config["base_model_name_or_path"]):
            raise UserError(
                f"cannot check that {directory} loads: its base, {config['base_model_name_or_path']}, is not on "
                "this machine; push from where the base is (or restore it at that path)"
            )
        choice = choose_base(config, directory, None, None, force=False)
        check_adapter_tensors(directory, load_base_config(choice))
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(load_causal_lm(choice.source, choice.revision, None), str(directory))
        except (RuntimeError, ValueError) as err:
            raise UserError(f"{directory} does not load onto {choice.source}: {err}") from None
        what = f"the adapter loads onto {choice.source}"
    else:
        model = load_causal_lm(str(directory), None, None)
        what = f"{directory} loads with AutoModelForCausalLM"
    vocab = model.get_input_embeddings().weight.shape[0]
    out = logits(model.eval(), [torch.arange(min(8, vocab)).unsqueeze(0)])[0]
    if not torch.isfinite(out).all():
        raise UserError(f"{directory} loads but its logits hold NaN or Inf; it was not pushed")
    params = sum(p.numel() for p in model.parameters())
    return f"checked: {what} ({params:,} parameters, finite logits)"
