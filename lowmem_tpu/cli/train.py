"""Training commands: ``train`` and one per method (``sft``, ``dpo``, ``orpo``, ``cpo``, ``simpo``, ``kto``), ``plot``
(a run's loss curve, even while it trains) and ``doctor`` (the
machine checked, then a few tiny steps trained: the first command on a TPU VM)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args
from lowmem_tpu.errors import NonFiniteError, UserError

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output_dir/final.")]
ForceResumeOpt = Annotated[
    bool, typer.Option("--force-resume", help="Resume even if the recipe changed since the checkpoint.")
]


def _train(command: str, recipe: str | None, overrides: list[str] | None, overwrite: bool, force_resume: bool) -> None:
    # the command names the method (``lowmem-tpu train`` runs the recipe's own)
    loaded = load_args(recipe, [*(overrides or []), *([f"method={command}"] if command != "train" else [])])
    try:
        from lowmem_tpu.run import run_training

        run = run_training(loaded, overwrite=overwrite, force_resume=force_resume)
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


def _method_command(name: str, help_text: str) -> None:
    """``lowmem-tpu NAME RECIPE [KEY=VALUE ...]``: a run of the method ``name`` (``train``: the recipe's own)."""

    def command(
        recipe: RecipeArg = None,
        overrides: OverridesArg = None,
        overwrite: OverwriteOpt = False,
        force_resume: ForceResumeOpt = False,
    ) -> None:
        _train(name, recipe, overrides, overwrite, force_resume)

    command.__doc__ = help_text
    app.command(name=name)(command)


# One command per method (config.methods), and ``train`` for the one the recipe names.
METHOD_COMMANDS = {
    "train": "Train as the recipe says: its method (sft, dpo, orpo, cpo, simpo, kto) with FSDP over every XLA device.",
    "sft": "Supervised fine-tuning (LoRA or full) with FSDP over every XLA device.",
    "dpo": "Preference tuning with DPO (TRL's DPOTrainer and its losses): LoRA on the FSDP-sharded base, the base "
    "as the reference (lora.enabled: false: the whole model, its reference's log-probabilities computed once "
    "before training). The data: preference pairs (data.format: preference); beta and the loss: preference.",
    "orpo": "ORPO (TRL's ORPOTrainer): SFT and preference in one stage, no reference; on preference pairs, "
    "preference.beta the odds-ratio weight.",
    "cpo": "CPO (TRL's CPOTrainer): a preference loss (preference.loss_type sigmoid, hinge or ipo) plus the chosen "
    "answers' NLL (preference.cpo_alpha), no reference; on preference pairs.",
    "simpo": "SimPO (TRL's CPOTrainer, loss simpo): length-normalized rewards with a target margin "
    "(preference.simpo_gamma), no reference; on preference pairs.",
    "kto": "KTO (TRL's KTOTrainer): desirable and undesirable completions, unpaired (data.format: unpaired, TRL's "
    "prompt/completion/label; or preference pairs, each read as two rows), against the base as the reference.",
}
for _name, _help in METHOD_COMMANDS.items():
    _method_command(_name, _help)


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
