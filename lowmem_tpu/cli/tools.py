"""The shipped ``recipes`` (list, copy) and ``doctor``, the first command on a TPU VM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import app
from lowmem_tpu.config import load_recipe
from lowmem_tpu.errors import UserError

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
    from lowmem_tpu.model.loading import require_config

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
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
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
