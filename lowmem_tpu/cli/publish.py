"""Commands after training: ``export`` a checkpoint, ``merge`` an adapter into its base, ``push`` to the Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import app
from lowmem_tpu.errors import UserError


@app.command()
def export(
    source: Annotated[
        Path,
        typer.Argument(
            help="A training checkpoint (output_dir/checkpoints/step-N); with --gguf, a finished run, its final/ "
            "(an adapter is merged first) or a model directory.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Where it goes (default: CHECKPOINT-export; with --gguf, RUN/gguf or SOURCE-gguf)."),
    ] = None,
    gguf: Annotated[
        str | None,
        typer.Option(
            "--gguf",
            help="Write GGUF files for llama.cpp, Ollama and LM Studio: f32, f16, bf16, q8_0 (comma-separated), "
            "each read back by transformers and llama.cpp before it is kept.",
        ),
    ] = None,
    vllm: Annotated[
        bool, typer.Option("--vllm", help="Check that vLLM's LoRA loader takes the adapter; print how to serve it.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="With --gguf: replace a non-empty --out.")] = False,
) -> None:
    """Turn a training checkpoint into the adapter or model final/ would hold; or a finished run into GGUF files
    (--gguf) and check its adapter for vLLM (--vllm)."""
    if vllm and gguf is None:
        from lowmem_tpu.publish.gguf.export import resolve_source
        from lowmem_tpu.publish.vllm import vllm_problems, vllm_summary

        directory, kind = resolve_source(source)
        if kind != "adapter":
            raise UserError(f"{directory} holds a full model, not a LoRA adapter: serve it with vllm serve {directory}")
        typer.echo(vllm_summary(directory))
        if vllm_problems(directory):
            raise typer.Exit(2)
        return
    if gguf is not None:
        from lowmem_tpu.publish.gguf.export import default_out, export_gguf, parse_types, summary
        from lowmem_tpu.publish.vllm import vllm_summary

        types = parse_types(gguf)
        target = out or default_out(source)
        report = export_gguf(source, types, target, force=force)
        typer.echo(summary(report, target))
        if report["kind"] == "adapter":
            typer.echo(vllm_summary(Path(report["source"])))
        elif vllm:
            typer.echo(f"vLLM serves the model as it is: vllm serve {report['source']}")
        return
    from lowmem_tpu.publish.export import export_checkpoint
    from lowmem_tpu.train.checkpoint import COMPLETE, EXPORT, STATE, read_trainable

    if not (source / COMPLETE).is_file() or not (source / STATE / ".metadata").is_file():
        raise UserError(
            f"{source} is not a complete training checkpoint (no {COMPLETE} marker or {STATE}/); "
            "give output_dir/checkpoints/step-N of a run, or add --gguf TYPE to write a finished run as GGUF"
        )
    target = out or source.with_name(source.name + "-export")
    kind = export_checkpoint(read_trainable(source), source / EXPORT, target)
    typer.echo(f"wrote the {kind} of {source} to {target}")


@app.command()
def merge(
    adapter_dir: Annotated[Path, typer.Argument(help="LoRA adapter directory (output_dir/final).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Directory for the merged model.", show_default=False)],
    base: Annotated[
        str | None, typer.Option("--base", help="Base model path or Hub id (default: the one the adapter records).")
    ] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Hub revision of the base (default: the recorded one).")
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="bfloat16 or float32.")] = "bfloat16",
    force: Annotated[
        bool, typer.Option("--force", help="Replace a non-empty --out; accept a base other than the recorded one.")
    ] = False,
    original_weights: Annotated[
        bool,
        typer.Option(
            "--original-weights",
            help="A quantized (QLoRA) run: merge into the full-precision checkpoint instead of the dequantized "
            "weights the adapters were trained and evaluated on.",
        ),
    ] = False,
) -> None:
    """Merge a LoRA adapter into its base on the CPU; the result is checked against base + adapter.

    A QLoRA run's adapters are merged into the dequantized weights they trained on (the model that
    generate and eval ran), checked against the quantized base + adapter.
    """
    from lowmem_tpu.publish.merge import merge_adapter

    merge_adapter(
        adapter_dir, out, base=base, revision=revision, dtype=dtype, force=force, original_weights=original_weights
    )


@app.command()
def push(
    directory: Annotated[
        Path, typer.Argument(help="Adapter directory (output_dir/final) or merged model directory.", show_default=False)
    ],
    repo_id: Annotated[str, typer.Option("--repo-id", help="OWNER/NAME on the Hugging Face Hub.", show_default=False)],
    private: Annotated[bool, typer.Option("--private", help="Create the repository as private.")] = False,
    revision: Annotated[str, typer.Option("--revision", help="Branch to commit to (created if missing).")] = "main",
    create: Annotated[bool, typer.Option("--create", help="Create the repository if it does not exist.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List the files and sizes that would be uploaded; no network.")
    ] = False,
    license: Annotated[
        str | None, typer.Option("--license", help="License id for the model card, e.g. apache-2.0.")
    ] = None,
    base_model: Annotated[
        str | None, typer.Option("--base-model", help="Hub id of the base, when the adapter records a local path.")
    ] = None,
) -> None:
    """Push an adapter or merged model with a generated model card and its recipe, as one commit."""
    from lowmem_tpu.publish.hub import format_plan
    from lowmem_tpu.publish.hub import push as push_directory

    result = push_directory(
        directory,
        repo_id,
        private=private,
        revision=revision,
        create=create,
        dry_run=dry_run,
        license=license,
        base_model=base_model,
    )
    typer.echo(format_plan(result))
    typer.echo("dry run: nothing uploaded" if dry_run else f"pushed: {result.commit_url}")
