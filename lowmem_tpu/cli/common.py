"""What every command shares: the typer app, the recipe arguments, loading, and how errors end (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from lowmem_tpu.config import Recipe, load_recipe
from lowmem_tpu.errors import UserError


class Commands(TyperGroup):
    """The command group: the one place a UserError from any command ends it (its problems on stderr, exit 2,
    no traceback); commands raise it, never exit 2 themselves."""

    def invoke(self, ctx: typer.Context) -> object:
        try:
            return super().invoke(ctx)
        except UserError as err:
            problems = err.problems
            typer.echo("error: invalid input:" if len(problems) > 1 else "error:", err=True, nl=len(problems) > 1)
            for problem in problems:
                typer.echo(f"  {problem}" if len(problems) > 1 else f" {problem}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=Commands,
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


def load_args(recipe: str | None, overrides: list[str] | None) -> Recipe:
    """The recipe named on the command line, with its overrides applied and validated."""
    path, extra = _split_args(recipe, overrides)
    return load_recipe(path, extra)
