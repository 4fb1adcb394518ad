"""Commands around one recipe: ``validate``, ``show``, ``sft``, ``dpo``, ``plot`` (its loss curve), ``memory``,
``compare``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args
from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.loading import default_recipe_path, shipped_recipes
from lowmem_tpu.errors import NonFiniteError, UserError


@app.command()
def validate(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Check a recipe (schema, files, batch split, layer class) without loading any weights."""
    loaded = load_args(recipe, overrides)
    from lowmem_tpu.config.checks import cpu_backend_problems
    from lowmem_tpu.config.platform import platform_for
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
    if rehearsal and platform_for("auto") == "CPU" and (problems := cpu_backend_problems(loaded)):
        needs = "; ".join(message for _, message in problems)
        typer.echo(f"note: no TPU here; a rehearsal on the CPU backend needs: {needs}")


@app.command()
def show(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Print the resolved recipe (extends merged, overrides applied, every default spelled out)."""
    typer.echo(load_args(recipe, overrides).to_yaml(), nl=False)


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
def memory(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help=f"{', '.join(DEVICES)} or cpu (default: the recipe's runtime.target, else the TPU here, else cpu).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON (bytes).")] = False,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Also compile the recipe's real training step and read the compiler's per-device peak "
            "(the TPU compiler on a TPU; else the CPU compiler on runtime.num_cpu_devices devices).",
        ),
    ] = False,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Compile the recipe's steady training step with the TPU compiler for --device (libtpu's "
            "compile-only client: no TPU needed, no weights made) and print its per-chip memory beside the "
            "planner's peak, and the step's time by libtpu's cost model.",
        ),
    ] = False,
    fill: Annotated[
        float | None,
        typer.Option(
            "--fill",
            min=0.01,
            max=1.0,
            help="With --compile: the share of row positions that are real tokens, for useful tokens/s "
            "(default: measured on the recipe's data when it and the tokenizer are at hand here).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Plan per-device memory of the recipe and its twin (LoRA <-> full); say what to turn on if it does not fit."""
    if compile_ and measure:
        raise UserError(
            "--measure and --compile each compile the step (for the devices here, for --device): one at a time"
        )
    if compile_:
        _compile(recipe, overrides, device, as_json, fill)
        return
    from lowmem_tpu.memory.advise import format_report, plan_recipe, report_json
    from lowmem_tpu.model.loading import require_config
    from lowmem_tpu.xla.tpu import default_device

    # Planning for a TPU: the batch must split over its devices (the planner checks), not the CPU's.
    loaded = load_args(recipe, [*(overrides or []), "runtime.device=tpu"]) if device != "cpu" else None
    device = device or default_device(loaded)
    if device == "cpu":
        loaded = load_args(recipe, overrides)
    report = plan_recipe(loaded, device, require_config(loaded))
    measured = _measure(load_args(recipe, overrides)) if measure else None
    if as_json:
        import json

        typer.echo(json.dumps(report_json(report) | ({"measured_peak": measured} if measured else {}), indent=2))
        return
    typer.echo(format_report(report))
    if measured:
        from lowmem_tpu.measure.compare import format_measurement

        typer.echo("\n" + format_measurement(measured))


def _compile(
    recipe: str | None, overrides: list[str] | None, device: str | None, as_json: bool, fill: float | None
) -> None:
    """``memory --compile``: the TPU compiler's verdict on the recipe's step for one TPU."""
    from lowmem_tpu.measure.tpu_compile import cleanup_on_sigterm, compile_target, require_compiler
    from lowmem_tpu.measure.tpu_layers import compile_or_extrapolate
    from lowmem_tpu.measure.tpu_report import compile_beside_plan
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.loading import require_config
    from lowmem_tpu.preflight import preflight

    loaded = load_args(recipe, [*(overrides or []), "runtime.device=tpu"])
    name = device or loaded.runtime.target
    if name in (None, "cpu"):
        raise UserError("--compile compiles for a TPU: name one with --device (e.g. v5e-8, v5e-1)")
    target = compile_target(name)
    require_compiler()
    preflight(loaded, scan="installed")  # the trace's child imports torchax; this process keeps jax out
    plan_recipe(loaded, target.name, require_config(loaded))  # a batch the chips do not split: refused first
    where = f"{target.devices} CPU device(s)"
    typer.echo(f"tracing the step on {where}, then compiling it for {target.name}...", err=True)
    cleanup_on_sigterm()
    compiled = compile_or_extrapolate(loaded, target)
    share, source = data_fill(loaded, fill)
    result, record, text = compile_beside_plan(loaded, target.name, compiled, share, source)
    if as_json:
        import json

        typer.echo(json.dumps(record, indent=2))
    else:
        typer.echo(text)
    if result.error:
        raise typer.Exit(1)


@app.command()
def tune(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target", help="The TPU to tune for (default: the recipe's runtime.target).", show_default=False
        ),
    ] = None,
    budget: Annotated[
        str, typer.Option("--budget", help="Stop compiling new candidates after this long, e.g. 30m, 1h.")
    ] = "30m",
    grow_batch: Annotated[
        bool,
        typer.Option("--grow-batch", help="Also try 2x and 4x the micro-batch per chip (the global batch grows)."),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="The tuned recipe (default: NAME_tuned.yaml here).", show_default=False),
    ] = None,
    keep: Annotated[
        str,
        typer.Option(
            "--keep",
            help="Knobs held as the recipe has them, comma-separated: rows, checkpointing, attention, packing.",
        ),
    ] = "",
) -> None:
    """Find the fastest settings that fit the target (micro-batch x checkpointing x attention x packing),
    each compiled by the TPU compiler, and write them as a new recipe that extends this one."""
    import json

    from lowmem_tpu.config.rules import parse_duration
    from lowmem_tpu.measure.tpu_compile import cleanup_on_sigterm, compile_target, require_compiler
    from lowmem_tpu.preflight import preflight
    from lowmem_tpu.tune import KNOBS, best, row, tune, tune_json, tuned_yaml

    loaded = load_args(recipe, [*(overrides or []), "runtime.device=tpu"])
    name = target or loaded.runtime.target
    if name in (None, "cpu"):
        raise UserError("tune compiles for a TPU: name one with --target (e.g. v5e-8, v5e-1)")
    device = compile_target(name)
    require_compiler()
    preflight(loaded, scan="installed")
    path = Path(recipe) if recipe else default_recipe_path()
    if not path.exists():
        path = shipped_recipes().get(path.stem, path)
    destination = out or Path(f"{path.stem}_tuned.yaml")
    cleanup_on_sigterm()

    def progress(k: int, total: int, item: Any) -> None:
        typer.echo(f"[{k}/{total}] {row(item)}", err=True)

    typer.echo(f"tuning {path.name} for {device.name}: each candidate traced here and compiled by libtpu", err=True)
    held = tuple(k.strip() for k in keep.split(",") if k.strip())
    if unknown := [k for k in held if k not in KNOBS]:
        raise UserError(f"--keep: unknown {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}")
    tried, fills, source = tune(loaded, device, parse_duration(budget), grow_batch, progress, held)
    chosen, baseline = best(tried), tried[0]
    if chosen is None:
        typer.echo(f"nothing fits {device.name}: no candidate fits per the TPU compiler; nothing written")
        raise typer.Exit(1)
    report = tune_json(tried, fills, source, device, overrides or [])
    destination.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    destination.write_text(tuned_yaml(path, destination, loaded, device, chosen, baseline, overrides or []))
    typer.echo(f"fastest that fits: {row(chosen)}")
    typer.echo(f"the recipe as given: {row(baseline)}")
    typer.echo(f"wrote {destination} (extends {path.name}) and {destination.with_suffix('.json')}")


def data_fill(recipe: Recipe, given: float | None) -> tuple[float | None, str]:
    """The rows' fill for useful tokens/s: ``--fill``, else measured on the recipe's data, else why not."""
    if given is not None:
        return given, "as stated (--fill)"
    from lowmem_tpu.measure.tpu_report import recipe_fill

    found = recipe_fill(recipe)
    share = found.of(recipe.data.packing)
    return share, f"measured on {found.samples} records of the recipe's data" if share is not None else found.why


def _measure(recipe: Recipe) -> dict:
    from lowmem_tpu.config.platform import on_tpu
    from lowmem_tpu.measure.compare import measure_beside_plan
    from lowmem_tpu.preflight import preflight

    preflight(recipe, platform=True, scan="installed")  # the step is compiled on this machine's backend
    where = "the TPU" if on_tpu(recipe.runtime.device) else f"{recipe.runtime.num_cpu_devices} CPU devices"
    typer.echo(f"compiling the real training step on {where} (minutes for a large model)...", err=True)
    return measure_beside_plan(recipe)


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
    loaded = load_args(recipe, overrides)
    from lowmem_tpu.measure.compare import compare_recipe, format_compare
    from lowmem_tpu.preflight import preflight

    preflight(loaded, platform=True, scan="installed")  # each mode is compiled (or run) on this machine

    result = compare_recipe(loaded, steps, out or Path(loaded.output_dir) / "compare")
    typer.echo(format_compare(result))
    where = out or Path(loaded.output_dir) / "compare"
    chart = result["chart"] or "no chart (pip install -c constraints.txt matplotlib)"
    typer.echo(f"wrote {where / 'compare.json'} and {chart}")
