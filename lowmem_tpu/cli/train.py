"""Training commands: ``sft``, ``dpo``, ``plot`` (a run's loss curve, even while it trains) and ``doctor`` (the
machine checked, then a few tiny steps trained: the first command on a TPU VM)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args
from lowmem_tpu.config import Recipe
from lowmem_tpu.errors import NonFiniteError, UserError

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output_dir/final.")]
ForceResumeOpt = Annotated[
    bool, typer.Option("--force-resume", help="Resume even if the recipe changed since the checkpoint.")
]


@app.command()
def sft(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    overwrite: OverwriteOpt = False,
    force_resume: ForceResumeOpt = False,
) -> None:
    """Supervised fine-tuning (LoRA or full) with FSDP over every XLA device."""
    _train("sft", recipe, overrides, overwrite, force_resume)


@app.command()
def dpo(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    overwrite: OverwriteOpt = False,
    force_resume: ForceResumeOpt = False,
) -> None:
    """Preference tuning with TRL's DPOTrainer: LoRA on the FSDP-sharded base, the base as the reference
    (lora.enabled: false: the whole model, its reference's log-probabilities computed once before training).

    The recipe's data is preference pairs (data.format: preference); its preference section holds beta and
    the loss."""
    _train("dpo", recipe, overrides, overwrite, force_resume)


def _train(command: str, recipe: str | None, overrides: list[str] | None, overwrite: bool, force_resume: bool) -> None:
    loaded = load_args(recipe, overrides)
    _check_method(command, loaded)
    try:
        from lowmem_tpu.sft import run_sft

        run = run_sft(loaded, overwrite=overwrite, force_resume=force_resume)
    except NonFiniteError as err:
        typer.echo(f"error: training diverged: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as err:
        from lowmem_tpu.files import disk_full

        if not disk_full(err):
            raise
        raise UserError(
            f"the disk of {loaded.output_dir} filled up while the run wrote to it ({err}); complete checkpoints "
            "are kept: free space there (or choose another output_dir) and run the same command again"
        ) from None
    if run.stopped in ("SIGTERM", "SIGINT"):
        raise typer.Exit(143 if run.stopped == "SIGTERM" else 130)


def _check_method(command: str, recipe: Recipe) -> None:
    """The data and the command agree: SFT trains on samples, DPO on preference pairs."""
    pairs = recipe.data.format == "preference"
    if command == "sft" and pairs:
        raise UserError(
            "data.format: preference holds preference pairs, which SFT does not train on: run "
            "`lowmem-tpu dpo` with this recipe, or give SFT data (text, alpaca, chat, prompt_completion, sharegpt)"
        )
    if command == "dpo" and not pairs:
        raise UserError(
            f"lowmem-tpu dpo trains on preference pairs and data.format is {recipe.data.format}: set data.format: "
            "preference with prompt/chosen/rejected data (TRL's preference formats), or run `lowmem-tpu sft`"
        )


@app.command()
def plot(
    run_dir: Annotated[
        Path,
        typer.Argument(
            help="A run's output_dir (where metrics.jsonl is written as it trains), or its final/ or a checkpoint.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where the PNG goes (default: RUN_DIR/loss.png).", show_default=False)
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the path and the summary as one JSON object.")] = False,
) -> None:
    """Draw a run's loss curve (loss, eval loss, learning rate, tokens/s against the step), even while it trains."""
    from lowmem_tpu.train.plot import LOSS_PNG, describe, draw, find_run, read_log, summarize

    found = find_run(run_dir)
    path = draw(found, out or found / LOSS_PNG)
    summary = summarize(read_log(found))
    if as_json:
        import json

        typer.echo(json.dumps({"path": str(path), "run_dir": str(found), **summary}))
        return
    typer.echo(f"wrote {path}: {describe(summary)}")


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
