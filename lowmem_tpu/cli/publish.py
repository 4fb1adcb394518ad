"""Commands after training: ``export`` a checkpoint, ``merge`` an adapter into its base, ``push`` to the Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import app
from lowmem_tpu.errors import UserError


@app.command()
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A training checkpoint (output_dir/checkpoints/step-N).", show_default=False)
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where the adapter or model goes (default: CHECKPOINT-export).")
    ] = None,
) -> None:
    """Turn a (sharded) training checkpoint into the adapter or model final/ would hold, for merge, generate, push."""
    from lowmem_tpu.publish.export import export_checkpoint
    from lowmem_tpu.train.checkpoint import COMPLETE, EXPORT, STATE, read_trainable

    if not (checkpoint / COMPLETE).is_file() or not (checkpoint / STATE / ".metadata").is_file():
        raise UserError(
            f"{checkpoint} is not a complete training checkpoint (no {COMPLETE} marker or {STATE}/); "
            "give output_dir/checkpoints/step-N of a run"
        )
    target = out or checkpoint.with_name(checkpoint.name + "-export")
    kind = export_checkpoint(read_trainable(checkpoint), checkpoint / EXPORT, target)
    typer.echo(f"wrote the {kind} of {checkpoint} to {target}")


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
