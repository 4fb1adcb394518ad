"""``lowmem-tpu export SOURCE --gguf TYPES``: a finished run as GGUF files, each checked by transformers' GGUF reader.

SOURCE is a run (its ``final/``), a LoRA adapter (merged first, as ``merge`` merges it: a QLoRA run into the
dequantized weights it trained on) or a model directory (a merged model, a full-parameter run's ``final/``).
Each file is written into a directory beside the output, read back by transformers (``gguf_file=``: its
own name map, un-permutation and dequantization) and its logits on the merge check's prompts compared
with the model's; the tokenizer read back from the file must give the same ids. Only then is the
directory renamed into place, with ``gguf.json`` (the figures) and a manifest.
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError
from lowmem_tpu.files import checkpoint_instead, fresh_partial, holding_output, publish, write_json, write_manifest
from lowmem_tpu.publish.gguf import llama_cpp
from lowmem_tpu.publish.gguf.check import UNREAD_BY_TRANSFORMERS, check_file, failure, transformers_reads
from lowmem_tpu.publish.gguf.metadata import check_describable
from lowmem_tpu.publish.gguf.writer import TYPES
from lowmem_tpu.publish.verify import logits, prompt_ids

REPORT = "gguf.json"


def parse_types(text: str) -> list[str]:
    """``--gguf f16,q8_0`` as a list; an unknown type exits 2 naming the ones there are."""
    types = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if t not in TYPES]
    if unknown or not types:
        raise UserError(f"--gguf {text}: unknown type {', '.join(unknown) or '(none)'}; choose from {', '.join(TYPES)}")
    return list(dict.fromkeys(types))


def resolve_source(source: Path) -> tuple[Path, str]:
    """The directory to export and what it is (``adapter`` or ``model``); an unfinished run is refused."""
    if not source.is_dir():
        raise UserError(f"{source}: no such directory; give a run's output_dir, its final/, or a merged model")
    if err := checkpoint_instead(source):
        raise err
    if (source / "final").is_dir():
        source = source / "final"
    if (source / "adapter_config.json").is_file():
        return source, "adapter"
    if _is_model(source):
        return source, "model"
    if (source / "checkpoints").is_dir() or (source / "metrics.jsonl").is_file():
        raise UserError(
            f"{source} is a run that has not finished (no final/): resume it with the same command, or export a "
            f"checkpoint first (lowmem-tpu export {source}/checkpoints/step-N --out DIR) and give DIR"
        )
    raise UserError(f"{source} holds neither a LoRA adapter nor a model (no adapter_config.json or config.json)")


def _is_model(directory: Path) -> bool:
    from lowmem_tpu.model.build import weight_files

    return (directory / "config.json").is_file() and bool(weight_files(directory))


def default_out(source: Path) -> Path:
    source = Path(source).resolve()
    source = source / "final" if (source / "final").is_dir() else source
    return source.parent / "gguf" if source.name == "final" else source.with_name(source.name + "-gguf")


def export_gguf(source: Path, types: list[str], out: Path | None = None, force: bool = False) -> dict[str, Any]:
    """Write ``source`` as one GGUF file per type into ``out``; returns the report (also ``out/gguf.json``)."""
    from lowmem_tpu.publish.merge import check_out_dir, cpu_only

    started = time.perf_counter()
    directory, kind = resolve_source(Path(source).resolve())
    out = Path(out).resolve() if out else default_out(Path(source))
    check_out_dir(out, [directory], force)
    cpu_only()
    config = _model_config(directory, kind)
    check_describable(config)  # refused before any weights are read
    if not transformers_reads(config) and not llama_cpp.available():
        text = config.get_text_config()
        raise UserError(
            f"a {text.model_type} GGUF file is checked by llama.cpp (transformers' GGUF reader cannot: "
            f"{UNREAD_BY_TRANSFORMERS[text.model_type]}), which is not installed: pip install -c "
            "constraints.txt -e '.[gguf]'"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "model":
        with holding_output(out, "--out"):
            check_out_dir(out, [directory], force)
            return _write_checked(directory, kind, directory, types, out, started)
    # The merge holds its own output while it runs; ours is held after it (one lock per directory at a time).
    # A fixed name: a copy left by a killed export is removed by the next.
    scratch = fresh_partial(out.parent / f".{out.name}", ".merge")
    try:
        model_dir = _merged(directory, scratch, types)
        with holding_output(out, "--out"):
            check_out_dir(out, [directory], force)
            return _write_checked(directory, kind, model_dir, types, out, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _model_config(directory: Path, kind: str) -> Any:
    """The config of the model a directory holds, or of the base an adapter goes onto (no weights read)."""
    from transformers import AutoConfig

    if kind == "model":
        return AutoConfig.from_pretrained(directory)
    from lowmem_tpu.publish.adapter_base import choose_base, load_base_config, read_adapter_config

    return load_base_config(choose_base(read_adapter_config(directory), directory, None, None, force=False))


def _merged(adapter: Path, scratch: Path, types: list[str]) -> Path:
    """The adapter merged into its base (checked by merge itself), in float32 unless only bf16 is asked."""
    from lowmem_tpu.publish.merge import merge_adapter

    dtype = "bfloat16" if types == ["bf16"] else "float32"
    return merge_adapter(adapter, scratch / "merged", dtype=dtype).out


def _write_checked(
    source: Path, kind: str, model_dir: Path, types: list[str], out: Path, started: float
) -> dict[str, Any]:
    from transformers import AutoConfig

    from lowmem_tpu.console import say
    from lowmem_tpu.model.build import weight_files
    from lowmem_tpu.publish.adapter_base import load_causal_lm
    from lowmem_tpu.publish.gguf.writer import write_gguf

    tokenizer = _tokenizer(model_dir)
    source_config = AutoConfig.from_pretrained(model_dir)
    rows = prompt_ids(tokenizer)
    reference = logits(load_causal_lm(str(model_dir), None, "float32"), rows)
    gc.collect()
    name = _model_name(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = fresh_partial(out.parent / f".{out.name}", ".gguf-partial")
    files: dict[str, Any] = {}
    try:
        for qtype in types:
            path = partial / f"{name}-{qtype.upper()}.gguf"
            say(f"writing {path.name}")
            written = write_gguf(model_dir, path, qtype, tokenizer, name)
            readers = ["transformers"] * transformers_reads(source_config) + ["llama.cpp"] * llama_cpp.available()
            say(f"reading {path.name} back with {' and '.join(readers)}")
            if not transformers_reads(source_config):
                why = UNREAD_BY_TRANSFORMERS[source_config.get_text_config().model_type]
                written["notes"].append(f"transformers does not read this file ({why}): llama.cpp alone checked it")
            check = check_file(partial, path.name, rows, reference, tokenizer, qtype, source_config)
            files[path.name] = {"type": qtype, "bytes": path.stat().st_size, **written, "check": check}
            for reader, figures in check.items():
                if not figures["passed"]:
                    raise UserError(failure(path.name, reader, figures, written["notes"]))
        source_bytes = sum(p.stat().st_size for p in weight_files(model_dir))
        report = {
            "source": str(source.resolve()),
            "kind": kind,
            "merged": kind == "adapter",
            "source_weight_bytes": source_bytes,
            "files": files,
            "llama_cpp_checked": llama_cpp.available(),
            "seconds": round(time.perf_counter() - started, 1),
        }
        write_json(partial / REPORT, report)
        write_manifest(partial)
        publish(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return report


def _tokenizer(model_dir: Path) -> Any:
    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import load_tokenizer

    return load_tokenizer(ModelSection(name_or_path=str(model_dir)))


def _model_name(source: Path) -> str:
    """The run's name (file names and ``general.name``). transformers 5.24 reads a LLAMA file whose name is
    exactly "mistral" with its Mistral class, which its GGUF loader then cannot map: that one name is suffixed."""
    name = source.parent.name if source.name == "final" else source.name
    return f"{name}-model" if name == "mistral" else name


def summary(report: dict[str, Any], out: Path) -> str:
    """The lines ``export`` prints."""
    lines = [f"wrote {len(report['files'])} GGUF file(s) to {out} ({report['seconds']:.0f} s)"]
    for name, entry in report["files"].items():
        lines.append(f"  {name}: {entry['bytes'] / 2**20:.1f} MiB, {entry['architecture']}, {entry['tokenizer']}")
        for reader, check in entry["check"].items():
            lines.append(
                f"    {reader}: logits within {check['relative_diff']:.1e} of the model (tolerance "
                f"{check['tolerance']:.2g}), top-1 {check['top1_agreement']:.3f}, token ids {check['token_ids']}"
                + (f", chat text: {check['chat_token_ids']}" if "chat_token_ids" in check else "")
            )
        lines += [f"    note: {note}" for note in entry.get("notes", [])]
    if not report["llama_cpp_checked"]:
        lines.append("  llama.cpp did not check the files: pip install -c constraints.txt -e '.[gguf]' adds it")
    lines.append(f"run it: llama-cli -m {out}/{next(iter(report['files']))}  (Ollama: FROM ./FILE in a Modelfile)")
    return "\n".join(lines)
