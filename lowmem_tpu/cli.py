"""The ``lowmem-tpu`` command line: parse, load the recipe, call one library function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.errors import UserError
from lowmem_tpu.recipe import Recipe, load_recipe

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
        from lowmem_tpu.modeling import check_model
        from lowmem_tpu.runtime import configure_environment

        configure_environment(loaded.runtime)
        summary = check_model(loaded)
    except UserError as err:
        _fail(err)
    typer.echo(f"ok: {recipe or 'embedded default'} is valid ({summary})")


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
) -> None:
    """Supervised fine-tuning (LoRA or full) with FSDP over every XLA device."""
    try:
        loaded = _load(recipe, overrides)
        from lowmem_tpu.sft import run_sft

        run_sft(loaded, overwrite=overwrite)
    except UserError as err:
        _fail(err)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def main() -> None:
    app(prog_name="lowmem-tpu")


if __name__ == "__main__":
    sys.exit(main())
