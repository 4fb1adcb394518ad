"""Commands that answer "will it fit, how fast": ``memory`` (the plan; ``--compile``: the compiler's verdict on
the real step), ``compare`` (LoRA against full fine-tuning) and ``tune`` (the fastest settings that fit)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lowmem_tpu.cli.common import OverridesArg, RecipeArg, app, load_args
from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.read import default_recipe_path, shipped_recipes
from lowmem_tpu.errors import UserError


def _target_option(help_text: str) -> Any:
    return typer.Option("--target", help=help_text, show_default=False)


TargetOpt = Annotated[
    str | None,
    _target_option(
        f"The device to plan for: {', '.join(DEVICES)} or cpu (default: the recipe's runtime.target, "
        "else the TPU here, else cpu)."
    ),
]


@app.command()
def memory(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    target: TargetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON (bytes).")] = False,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Compile the recipe's real training step for --target and print the compiler's per-device "
            "memory beside the plan: for a TPU, libtpu's compile-only client (no TPU needed, no weights made) "
            "and the step's time by its cost model; for cpu, XLA:CPU on runtime.num_cpu_devices devices.",
        ),
    ] = False,
    fill: Annotated[
        float | None,
        typer.Option(
            "--fill",
            min=0.01,
            max=1.0,
            help="With --compile for a TPU: the share of row positions that are real tokens, for useful "
            "tokens/s (default: measured on the recipe's data when it and the tokenizer are at hand here).",
            show_default=False,
        ),
    ] = None,
    measure: Annotated[bool, typer.Option("--measure", hidden=True)] = False,
    device: Annotated[str | None, typer.Option("--device", hidden=True)] = None,
) -> None:
    """Plan per-device memory of the recipe and its twin (LoRA <-> full); say what to turn on if it does not fit.
    With --compile: the compiler's verdict on the real step for the same device (--json: the compiler's record
    for a TPU; the plans and the compiled figures under "compiled" for cpu)."""
    if measure or device:
        raise UserError("memory: for --measure use --compile --target cpu, for --device use --target (a TPU, or cpu)")
    from lowmem_tpu.memory.advise import format_report, plan_recipe, report_json
    from lowmem_tpu.model.build import require_config
    from lowmem_tpu.xla.tpu import default_device

    # Planning for a TPU: the batch must split over its devices (the planner checks), not the CPU's.
    loaded = load_args(recipe, [*(overrides or []), "runtime.device=tpu"]) if target != "cpu" else None
    target = target or default_device(loaded)
    if target == "cpu":
        loaded = _here(load_args(recipe, [*(overrides or []), "runtime.device=cpu"]))
    if compile_ and target != "cpu":
        _compile_tpu(loaded, target, as_json, fill)
        return
    if fill is not None:
        raise UserError("--fill: the share of real tokens for a TPU's step estimate (--compile --target TPU)")
    report = plan_recipe(loaded, target, require_config(loaded))
    measured = _compile_cpu(loaded) if compile_ else None
    from lowmem_tpu.measure.tpu_report import recorded_verdict

    name = _shipped_name(recipe) if not overrides else None
    verdict = recorded_verdict(name, target, report.plan) if name else None
    if as_json:
        import json

        extra = ({"compiled": measured} if measured else {}) | ({"compiler_record": verdict} if verdict else {})
        typer.echo(json.dumps(report_json(report) | extra, indent=2))
        return
    typer.echo(format_report(report))
    if verdict:
        typer.echo(f"\n{verdict['text']}")
    if measured:
        from lowmem_tpu.measure.compare import format_measurement

        typer.echo("\n" + format_measurement(measured))


def _shipped_name(recipe: str | None) -> str | None:
    """The shipped recipe's name when ``recipe`` is one (by name or by its own path), else None."""
    if not recipe:
        return None
    path, shipped = Path(recipe), shipped_recipes().get(Path(recipe).stem)
    return path.stem if shipped and (not path.exists() or path.resolve() == shipped.resolve()) else None


def _compile_tpu(loaded: Recipe, name: str, as_json: bool, fill: float | None) -> None:
    """``memory --compile`` for a TPU: libtpu's verdict on the recipe's step, and the step's time."""
    from lowmem_tpu.measure.tpu_compile import cleanup_on_sigterm, compile_target, require_compiler
    from lowmem_tpu.measure.tpu_layers import compile_or_extrapolate
    from lowmem_tpu.measure.tpu_report import compile_beside_plan
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config
    from lowmem_tpu.preflight import preflight

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


def _compile_cpu(recipe: Recipe) -> dict:
    """``memory --compile --target cpu``: XLA:CPU's per-device peak of the real step on the CPU devices."""
    from lowmem_tpu.measure.compare import measure_beside_plan
    from lowmem_tpu.preflight import preflight

    recipe = _here(recipe)
    preflight(recipe, platform=True, scan="installed")
    typer.echo(
        f"compiling the real training step on {recipe.runtime.num_cpu_devices} CPU devices "
        "(minutes for a large model)...",
        err=True,
    )
    return measure_beside_plan(recipe)


@app.command()
def tune(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    target: Annotated[str | None, _target_option("The TPU to tune for (default: the recipe's runtime.target).")] = None,
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
            help="Knobs held as the recipe has them, comma-separated: placement, rows, checkpointing, attention, "
            "packing.",
        ),
    ] = "",
) -> None:
    """Find the fastest settings that fit the target (where the weights live x micro-batch x checkpointing x
    attention x packing), each compiled by the TPU compiler, and write them as a new recipe that extends this one."""
    import json

    from lowmem_tpu.config.rules import parse_duration
    from lowmem_tpu.measure.tpu_compile import cleanup_on_sigterm, compile_target, require_compiler
    from lowmem_tpu.measure.tune import KNOBS, best, row, tune, tune_json, tuned_yaml
    from lowmem_tpu.preflight import preflight

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


def _here(recipe: Recipe) -> Recipe:
    """The recipe as this machine compiles or runs it, each TPU-only setting replaced said on stderr."""
    from lowmem_tpu.preflight import as_run_here

    recipe, notes = as_run_here(recipe)
    for note in notes:
        typer.echo(note, err=True)
    return recipe


def data_fill(recipe: Recipe, given: float | None) -> tuple[float | None, str]:
    """The rows' fill for useful tokens/s: ``--fill``, else measured on the recipe's data, else why not."""
    if given is not None:
        return given, "as stated (--fill)"
    from lowmem_tpu.measure.tpu_report import recipe_fill

    found = recipe_fill(recipe)
    share = found.of(recipe.data.packing)
    return share, f"measured on {found.samples} records of the recipe's data" if share is not None else found.why


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
    loaded = _here(load_args(recipe, overrides))
    from lowmem_tpu.measure.compare import compare_recipe, format_compare
    from lowmem_tpu.preflight import preflight

    preflight(loaded, platform=True, scan="installed")  # each mode is compiled (or run) on this machine

    result = compare_recipe(loaded, steps, out or Path(loaded.output_dir) / "compare")
    typer.echo(format_compare(result))
    where = out or Path(loaded.output_dir) / "compare"
    chart = result["chart"] or "no chart (pip install -c constraints.txt matplotlib)"
    typer.echo(f"wrote {where / 'compare.json'} and {chart}")
