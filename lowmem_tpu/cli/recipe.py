"""Commands that read a recipe and load no weights: ``validate``, ``show``, ``data`` (its first rows as the
model sees them) and ``recipes`` (the shipped ones: list, copy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args
from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.errors import UserError


@app.command()
def validate(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Check a recipe (schema, files, batch split, layer class) without loading any weights."""
    loaded = load_args(recipe, overrides)
    from lowmem_tpu.config.checks import cpu_backend_problems, cpu_equivalents
    from lowmem_tpu.machine import platform_for
    from lowmem_tpu.preflight import preflight
    from lowmem_tpu.xla.runtime import configure_environment

    configure_environment(loaded.runtime)  # before the model check imports transformers
    # A valid recipe may still not run here: the backend it lands on, the target's split, the [scan] extra.
    # A TPU recipe (runtime.device auto, a TPU target) validated off a TPU is valid: what a CPU rehearsal of
    # it would need is said, not refused.
    rehearsal = loaded.runtime.device == "auto" and loaded.runtime.target not in (None, "cpu")
    summary = preflight(loaded, platform=not rehearsal, target=True, scan="installed", model=True)
    target = f"; sized for {loaded.runtime.target}" if loaded.runtime.target else ""
    typer.echo(f"ok: {recipe or 'embedded default'} is valid ({summary}{target})")
    needs = [message for _, message in cpu_backend_problems(loaded)] if rehearsal else []
    if platform_for(loaded.runtime.device) == "CPU":
        if needs:
            typer.echo(f"note: no TPU here; a rehearsal on the CPU backend needs: {'; '.join(needs)}")
        if runs := [f"{field}={value}" for field, value, _ in cpu_equivalents(loaded)]:
            typer.echo(f"note: on the CPU backend a run computes {', '.join(runs)} instead (the same attention)")


@app.command()
def show(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Print the resolved recipe (extends merged, overrides applied, every default spelled out)."""
    typer.echo(load_args(recipe, overrides).to_yaml(), nl=False)


OPEN, CLOSE = "\u27e6", "\u27e7"  # marks trained text when there is no colour


@app.command()
def data(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    rows: Annotated[int, typer.Option("--rows", min=0, help="Records to show.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """Show the first records as training will see them (trained tokens marked), and how many records are
    truncated or dropped; loads the tokenizer, no weights. The rows land in the run's tokenization cache."""
    loaded = load_args(recipe, overrides)
    if loaded.runtime.quiet:
        from lowmem_tpu.console import quiet_python_warnings

        quiet_python_warnings()
    from lowmem_tpu import model
    from lowmem_tpu.data import set_chat_template
    from lowmem_tpu.data.preview import counts, first_records

    tokenizer = model.load_tokenizer(loaded.model)
    chosen = set_chat_template(tokenizer, loaded.data)
    source, shown = first_records(loaded.data, tokenizer, rows)
    cfg = loaded.data
    if not as_json:
        _print_rows(source, cfg.format, cfg.max_length, chosen, shown, color=sys.stdout.isatty())
        typer.echo(f"\ncounting every record (the rows go to {loaded.output_dir}/data_cache)...", err=True)
    method = METHODS[loaded.method]
    stats = counts(cfg, tokenizer, Path(loaded.output_dir) / "data_cache", unpaired=method.rows == "unpaired")
    if as_json:
        report = {"source": source, "format": cfg.format, "max_length": cfg.max_length, "chat_template": chosen}
        typer.echo(json.dumps(report | {"stats": stats, "rows": shown}, indent=2))
        return
    _print_counts(stats, cfg.max_length, "pairs of rows" if method.pairs else "rows")


def _print_rows(source: str, fmt: str, length: int, chosen: str | None, shown: list[dict], color: bool) -> None:
    mark = "in green" if color else f"{OPEN}like this{CLOSE}"
    typer.echo(f"{source}: format {fmt}, max_length {length}")
    if chosen:
        typer.echo(chosen)
    typer.echo(f"trained tokens are shown {mark}; the rest is masked (seen, not learned)")
    for row in shown:
        side = f" ({row['side']})" if row["side"] else ""
        typer.echo(
            f"\n--- record {row['record']}{side}: {row['tokens']} tokens, {row['trained']} trained; {row['fate']}"
        )
        typer.echo("".join(_span(trained, text, color) for trained, text in row["spans"]))


def _print_counts(s: dict[str, Any], length: int, rows: str) -> None:
    from lowmem_tpu.data.rows import describe_cuts

    lengths = s["lengths"]
    typer.echo(
        f"all {s['samples']:,} records -> {s['rows']:,} {rows} of {length} tokens: {describe_cuts(s)}; "
        f"tokens per record: median {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, "
        f"longest {lengths['max']}; {s['trained_tokens']:,} of {s['tokens']:,} tokens trained"
    )
    if s["rows"]:
        fill = s["tokens"] / (s["rows"] * length * (2 if rows == "pairs of rows" else 1))
        typer.echo(f"rows {fill:.1%} full (real tokens over positions: `memory --compile --fill {fill:.2f}`)")


def _span(trained: bool, text: str, color: bool) -> str:
    if not color:
        return f"{OPEN}{text}{CLOSE}" if trained else text
    return typer.style(text, fg="green", bold=True) if trained else typer.style(text, dim=True)


recipes_app = typer.Typer(
    help="The shipped recipes: list them (purpose, target TPU, planned memory), copy one to edit.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(recipes_app, name="recipes")


@recipes_app.callback()
def recipes(ctx: typer.Context) -> None:
    """List the shipped recipes by model family, with their purpose, target device and planned memory per device."""
    if ctx.invoked_subcommand is not None:
        return
    from lowmem_tpu.config.features import text_config
    from lowmem_tpu.config.shipped import describe_shipped
    from lowmem_tpu.memory.advise import gib, on_the_edge, plan_recipe
    from lowmem_tpu.model.build import require_config

    by_family: dict[str, list[str]] = {}
    for item in describe_shipped():
        family = "unknown"
        try:
            device = item.target or "cpu"
            loaded = load_recipe(item.path, [] if device == "cpu" else ["runtime.device=tpu"])
            config = require_config(loaded)
            family = str(getattr(text_config(config), "model_type", family))
            plan = plan_recipe(loaded, device, config).plan
            memory = f"{gib(plan.needed)} of {gib(plan.capacity)} per device on {device}"
            if on_the_edge(plan):
                memory += " with its margin (on the edge: `memory --compile` gives the compiler's verdict)"
        except UserError as err:
            memory = f"not planned: {err}"
        entry = f"  {item.name}\n      {item.purpose}\n      target {item.target or 'none'}; planned {memory}"
        by_family.setdefault(FAMILIES.get(family, family), []).append(entry)
    for family, entries in sorted(by_family.items()):
        typer.echo(f"{family}:\n" + "\n".join(entries))
    typer.echo("copy one to edit: lowmem-tpu recipes copy NAME DEST")


# A config's model_type, as people name the family.
FAMILIES = {
    "llama": "Llama (Open Llama, Llama 2/3)",
    "qwen2": "Qwen 2.5",
    "qwen3": "Qwen 3",
    "qwen3_moe": "Qwen 3 MoE",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
    "gemma4_text": "Gemma 4",
    "gpt_oss": "gpt-oss",
    "mistral": "Mistral",
    "phi3": "Phi-3 / Phi-4",
}


@recipes_app.command("copy")
def recipes_copy(
    name: Annotated[str, typer.Argument(help="A shipped recipe's name, e.g. open_llama_lora.", show_default=False)],
    dest: Annotated[Path, typer.Argument(help="A file, or a directory to write NAME.yaml in.", show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace files that exist.")] = False,
) -> None:
    """Write a shipped recipe (and the recipes it extends, beside it) to DEST, ready to edit and validate."""
    from lowmem_tpu.config.shipped import copy_recipe

    written = copy_recipe(name, dest, force)
    typer.echo(f"wrote {', '.join(map(str, written))}; check it with: lowmem-tpu validate {written[0]}")
