"""The ``lowmem-tpu`` command line: parse, load the recipe, call one library function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.config import Recipe, load_recipe
from lowmem_tpu.errors import NonFiniteError, UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Fine-tune LLMs on TPUs without running out of memory (LoRA or full FSDP, one YAML recipe).",
)

RecipeArg = Annotated[
    str | None,
    typer.Argument(help="Recipe YAML (default: the embedded tiny CPU demo).", show_default=False),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Overrides as section.key=value, e.g. train.max_steps=50 lora.r=8.", show_default=False),
]


def _split_args(recipe: str | None, overrides: list[str] | None) -> tuple[str | None, list[str]]:
    """Allow ``lowmem-tpu sft train.max_steps=5``: a first argument with ``=`` is an override."""
    overrides = list(overrides or [])
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    return recipe, overrides


def _fail(err: UserError) -> None:
    typer.echo("error: invalid input:" if len(err.problems) > 1 else "error:", err=True, nl=len(err.problems) > 1)
    for problem in err.problems:
        typer.echo(f"  {problem}" if len(err.problems) > 1 else f" {problem}", err=True)
    raise typer.Exit(2)


def _load(recipe: str | None, overrides: list[str] | None) -> Recipe:
    path, extra = _split_args(recipe, overrides)
    return load_recipe(path, extra)


@app.command()
def validate(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Check a recipe (schema, files, batch split, layer class) without loading any weights."""
    try:
        loaded = _load(recipe, overrides)
        from lowmem_tpu.config.schema import target_problem
        from lowmem_tpu.model import check_model
        from lowmem_tpu.xla.runtime import configure_environment

        problem = target_problem(loaded)
        if problem:
            raise UserError(problem)
        configure_environment(loaded.runtime)
        summary = check_model(loaded)
    except UserError as err:
        _fail(err)
    target = f"; sized for {loaded.runtime.target}" if loaded.runtime.target else ""
    typer.echo(f"ok: {recipe or 'embedded default'} is valid ({summary}{target})")


@app.command()
def show(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Print the resolved recipe (extends merged, overrides applied, every default spelled out)."""
    try:
        typer.echo(_load(recipe, overrides).to_yaml(), nl=False)
    except UserError as err:
        _fail(err)


@app.command()
def sft(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output_dir/final.")] = False,
    force_resume: Annotated[
        bool, typer.Option("--force-resume", help="Resume even if the recipe changed since the checkpoint.")
    ] = False,
) -> None:
    """Supervised fine-tuning (LoRA or full) with FSDP over every XLA device."""
    try:
        loaded = _load(recipe, overrides)
        from lowmem_tpu.sft import run_sft

        run = run_sft(loaded, overwrite=overwrite, force_resume=force_resume)
    except NonFiniteError as err:
        typer.echo(f"error: training diverged: {err}", err=True)
        raise typer.Exit(1) from None
    except UserError as err:
        _fail(err)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    if run.stopped == "SIGTERM":
        raise typer.Exit(143)


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
) -> None:
    """Merge a LoRA adapter into its base on the CPU; the result is checked against base + adapter."""
    try:
        from lowmem_tpu.publish.merge import merge_adapter

        merge_adapter(adapter_dir, out, base=base, revision=revision, dtype=dtype, force=force)
    except UserError as err:
        _fail(err)


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
    try:
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
    except UserError as err:
        _fail(err)
    typer.echo(format_plan(result))
    typer.echo("dry run: nothing uploaded" if dry_run else f"pushed: {result.commit_url}")


@app.command()
def memory(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="v5e-1, v5e-4, v5e-8, v6e-1, v6e-4, v6e-8, v4-8, v5p-8, v3-8, v2-8 or cpu "
            "(default: the recipe's runtime.target, else the TPU here, else cpu).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON (bytes).")] = False,
) -> None:
    """Plan per-device memory of the recipe and its twin (LoRA <-> full); say what to turn on if it does not fit."""
    try:
        from lowmem_tpu.memory.advise import default_device, format_report, plan_recipe, report_json

        # Planning for a TPU: the batch must split over its devices (the planner checks), not the CPU's.
        loaded = _load(recipe, [*(overrides or []), "runtime.device=tpu"]) if device != "cpu" else None
        device = device or default_device(loaded)
        if device == "cpu":
            loaded = _load(recipe, overrides)
        report = plan_recipe(loaded, device)
    except UserError as err:
        _fail(err)
    if as_json:
        import json

        typer.echo(json.dumps(report_json(report), indent=2))
    else:
        typer.echo(format_report(report))


@app.command()
def compare(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    steps: Annotated[
        int, typer.Option("--steps", min=3, help="Real steps per mode on a TPU (on the CPU one step is compiled).")
    ] = 5,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Where compare.json and compare.png go (default: output_dir/compare)."),
    ] = None,
) -> None:
    """LoRA vs full fine-tuning per device: planned beside measured (TPU runtime peak, or the CPU compiler's)."""
    try:
        loaded = _load(recipe, overrides)
        from lowmem_tpu.memory.compare import compare_recipe, format_compare

        result = compare_recipe(loaded, steps, out or Path(loaded.output_dir) / "compare")
    except UserError as err:
        _fail(err)
    typer.echo(format_compare(result))
    where = out or Path(loaded.output_dir) / "compare"
    chart = result["chart"] or "no chart (pip install -c constraints.txt matplotlib)"
    typer.echo(f"wrote {where / 'compare.json'} and {chart}")


@app.command()
def doctor(
    out: Annotated[Path, typer.Option("--out", help="Where the JSON report goes.")] = Path("lowmem-tpu-doctor.json"),
    skip_train: Annotated[
        bool, typer.Option("--skip-train", help="Check the installation and platform only; train nothing.")
    ] = False,
) -> None:
    """Check this machine (versions, TPU, libtpu, RAM, compile cache), then train a few tiny bf16 steps.

    Run it first on a TPU VM and paste its output (or the JSON) into a bug report. Exit 1 when a
    check fails; the report is written either way.
    """
    from lowmem_tpu.doctor import run_doctor

    report = run_doctor(out, train=not skip_train, echo=typer.echo)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    warned = [c["name"] for c in report["checks"] if c["status"] == "warn"]
    verdict = f"{len(failed)} failed ({', '.join(failed)})" if failed else "all checks passed"
    typer.echo(f"{verdict}{f'; {len(warned)} warning(s)' if warned else ''}; wrote {out}")
    raise typer.Exit(1 if failed else 0)


def main() -> None:
    app(prog_name="lowmem-tpu")


if __name__ == "__main__":
    sys.exit(main())
