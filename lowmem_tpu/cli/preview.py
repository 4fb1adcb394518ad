"""``data``: a recipe's first records as the model will see them, and the counts over all of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args

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
    stats = counts(cfg, tokenizer, Path(loaded.output_dir) / "data_cache")
    if as_json:
        report = {"source": source, "format": cfg.format, "max_length": cfg.max_length, "chat_template": chosen}
        typer.echo(json.dumps(report | {"stats": stats, "rows": shown}, indent=2))
        return
    _print_counts(stats, cfg.max_length, "pairs of rows" if cfg.format == "preference" else "rows")


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
