"""``lowmem-tpu tune RECIPE``: the fastest settings that fit the target, by the TPU compiler.

It searches where the weights live (sharded over every chip, FSDP, or a whole copy on each: no weight is
gathered, only the gradients are reduced) x the micro-batch per chip x activation checkpointing (every layer,
every_2, every_4, none) x attention (the recipe's, and flash where the target, the length and the model allow
it) x packing (where the data is at hand and packing fills rows fuller). The planner drops what is far from
fitting; each survivor is compiled by libtpu for the target (at 2 and 4 layers, extrapolated, for a model of
more than 4 layers) and ranked by useful tokens/s/chip under libtpu's cost model
(``measure.tpu_report.step_estimate``). The recipe as given is compiled first, as the baseline. The fastest
candidate that fits is written as a new recipe that ``extends`` the original and names only what changed, its
header saying why; the original is untouched.

The global batch is the recipe's (the optimizer sees the same batches): a smaller micro-batch per chip
takes gradient accumulation; ``grow_batch`` also tries micro-batches up to 4x the recipe's, the
global batch growing with them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, RecipeError, with_overrides
from lowmem_tpu.config.checks import flash_tiles
from lowmem_tpu.config.devices import Device
from lowmem_tpu.config.methods import METHODS

CHECKPOINTING: tuple[bool | str, ...] = (False, "every_4", "every_2", True)  # least recomputation first
PLANNER_MARGIN = 1.25  # the planner is within -19%..+23% of the compiler on the shipped recipes: keep what it puts near


@dataclass(frozen=True)
class Candidate:
    """One setting tried: rows per chip per micro-batch, checkpointing, attention, packing.

    A preference recipe's rows are pairs (``unit``), each a chosen and a rejected row of tokens."""

    rows: int
    accumulation: int
    checkpointing: bool | str
    attention: str
    packing: bool
    unit: str = "rows"
    placement: str = "fsdp"  # sharding.strategy: fsdp, or replicated (a copy of every weight on each chip)

    def overrides(self, devices: int) -> list[str]:
        return [
            f"sharding.strategy={self.placement}",
            f"train.global_batch_size={self.rows * devices * self.accumulation}",
            f"train.gradient_accumulation_steps={self.accumulation}",
            f"sharding.activation_checkpointing={str(self.checkpointing).lower()}",
            f"model.attn_implementation={self.attention}",
            f"data.packing={str(self.packing).lower()}",
        ]

    def needs_at_least(self, other: Candidate) -> bool:
        """Whether this setting holds at least what ``other`` holds: as many rows or more, as few layers
        recomputed or fewer, the same packing and the same attention or eager where ``other`` has flash
        (eager keeps every live layer's scores, flash none) and the weights replicated where ``other`` shards them,
        so over the chip wherever ``other`` is. Every
        stored search (benchmarks/results/tune_*.json) agrees: no eager setting fit where such a flash one did not.
        A program of micro-batches is compared only with another: it keeps the gradients between them, which a
        whole step does not (for full fine-tuning, more than a micro-batch's activations)."""
        attention = self.attention == other.attention or (self.attention, other.attention) == ("eager", "flash")
        placement = self.placement == other.placement or (self.placement, other.placement) == ("replicated", "fsdp")
        return (
            attention
            and placement
            and self.packing == other.packing
            and (self.accumulation > 1) == (other.accumulation > 1)  # micro-batches: another program
            and self.rows >= other.rows
            and CHECKPOINTING.index(self.checkpointing) <= CHECKPOINTING.index(other.checkpointing)
        )

    def describe(self) -> str:
        ckpt = {True: "every layer", False: "none"}.get(self.checkpointing, self.checkpointing)  # type: ignore[arg-type]
        accumulation = f" x {self.accumulation} accumulated" if self.accumulation > 1 else ""
        packed = "packed" if self.packing else "padded"
        unit = self.unit if self.rows > 1 else self.unit.removesuffix("s")
        where = f"{self.rows} {unit}/chip{accumulation}, checkpointing {ckpt}"
        return f"{where}, {self.attention}, {packed}, {self.placement}"


@dataclass
class Tried:
    """A candidate and what became of it: skipped by the planner, compiled (fits or not), or failed."""

    candidate: Candidate
    planned: int | None = None
    verdict: str = "not compiled"
    needed: int | None = None
    held: int | None = None  # needed + the program's code + the line's error: what the margin is kept beside
    fits: bool = False
    estimate: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def speed(self) -> float:
        """Useful tokens/s/chip (every position's when the fill is not known): what the search ranks by."""
        e = self.estimate
        return e.get("useful_tokens_per_second_per_chip") or e.get("tokens_per_second_per_chip") or 0.0


KNOBS = ("placement", "rows", "checkpointing", "attention", "packing")


def candidates(
    recipe: Recipe,
    device: Device,
    fills: dict[bool, float | None],
    grow_batch: bool,
    keep: tuple[str, ...] = (),
    flash: bool = True,
) -> list[Candidate]:
    """Every setting to try: the recipe's own first, then the least recomputation first and, within it, the
    fewest rows first (a setting over the chip rules out every one holding more: :meth:`Candidate.needs_at_least`).

    ``keep``: knobs (of :data:`KNOBS`) held as the recipe has them; ``flash``: whether the model's attention
    allows flash (:func:`flash_allowed`)."""
    train, chips = recipe.train, device.devices
    rows_now = train.global_batch_size // train.gradient_accumulation_steps // chips
    per_step = train.global_batch_size // chips  # rows per chip per optimizer step
    sizes = {r: per_step // r for r in range(1, per_step + 1) if per_step % r == 0}
    if grow_batch:
        sizes |= {rows_now * k: 1 for k in (2, 4)}
    attentions = [recipe.model.attn_implementation]
    if flash and device.generation != "cpu" and "flash" not in attentions and flash_tiles(recipe.data.max_length):
        attentions.append("flash")
    packings = [recipe.data.packing]
    if fills.get(True) and fills.get(False) and fills[True] > fills[False] and not recipe.data.packing:
        packings.append(True)
    unit = "pairs" if METHODS[recipe.method].pairs else "rows"
    own = Candidate(
        rows_now,
        train.gradient_accumulation_steps,
        recipe.sharding.activation_checkpointing,
        recipe.model.attn_implementation,
        recipe.data.packing,
        unit,
        recipe.sharding.strategy,
    )
    placements = [own.placement] if "placement" in keep or chips == 1 else ["fsdp", "replicated"]
    if "rows" in keep:
        sizes = {own.rows: own.accumulation}
    grid = [
        Candidate(rows, accumulation, ckpt, attention, packing, unit, placement)
        for placement in placements
        for ckpt in ([own.checkpointing] if "checkpointing" in keep else CHECKPOINTING)
        for attention in ([own.attention] if "attention" in keep else reversed(attentions))
        for packing in ([own.packing] if "packing" in keep else reversed(packings))
        for rows, accumulation in sorted(sizes.items())
    ]
    return [own, *[c for c in grid if c != own]]


def tune(
    recipe: Recipe,
    device: Device,
    budget_seconds: float,
    grow_batch: bool = False,
    report: Callable[[int, int, Tried], None] | None = None,
    keep: tuple[str, ...] = (),
) -> tuple[list[Tried], dict[bool, float | None], str]:
    """Try the candidates within ``budget_seconds``; returns what was tried, the fills and their source."""
    from lowmem_tpu.measure.tpu_report import recipe_fill

    found = recipe_fill(recipe)
    fills = {False: found.padded, True: found.packed}
    source = f"measured on {found.samples} records of the recipe's data" if found.padded else found.why
    started = time.monotonic()
    tried: list[Tried] = []
    grid = candidates(recipe, device, fills, grow_batch, keep, flash_allowed(recipe))
    for k, candidate in enumerate(grid):
        item = Tried(candidate)
        tried.append(item)
        over = next((t for t in tried if t.verdict == "does not fit" and candidate.needs_at_least(t.candidate)), None)
        if k and time.monotonic() - started > budget_seconds:
            item.verdict = "not compiled (time budget spent)"
        elif over:
            item.verdict = f"skipped: holds at least what {over.candidate.describe()} holds, over the chip"
        else:
            _try(recipe, device, item, fills.get(candidate.packing), source)
        if report:
            report(k + 1, len(grid), item)
    return tried, fills, source


def flash_allowed(recipe: Recipe) -> bool:
    """Whether flash computes the recipe's model at its length (no window its rows meet, no soft-capped scores)."""
    from lowmem_tpu.config.features import attention_of
    from lowmem_tpu.model.build import require_config

    return attention_of(require_config(recipe)).flash_refusal(recipe.data.max_length) is None


def _try(recipe: Recipe, device: Device, item: Tried, fill: float | None, source: str) -> None:
    from lowmem_tpu.errors import UserError
    from lowmem_tpu.measure.tpu_compile import compile_recipe
    from lowmem_tpu.measure.tpu_layers import compile_by_layers, layer_points, layers_of
    from lowmem_tpu.measure.tpu_report import compile_beside_plan
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config

    started = time.monotonic()
    try:
        trial = with_overrides(recipe, item.candidate.overrides(device.devices))
        plan = plan_recipe(trial, device.name, require_config(trial)).plan
    except (RecipeError, UserError) as err:
        item.verdict = f"not valid: {str(err).splitlines()[0][:120]}"
        return
    item.planned = plan.peak
    if plan.peak > plan.capacity * PLANNER_MARGIN:
        item.verdict = "skipped: the planner puts it far over"
        return
    try:
        if layers_of(trial) > layer_points(trial)[-1]:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="lowmem-tpu-tune-") as tmp:
                result = compile_by_layers(trial, device, Path(tmp))
        else:
            result = compile_recipe(trial, device)
    except UserError as err:
        item.verdict = f"failed: {str(err).splitlines()[0][:120]}"
        return
    _, record, _ = compile_beside_plan(trial, device.name, result, fill, source)
    item.seconds = time.monotonic() - started
    item.needed, item.held, item.fits = result.needed, result.held, result.fits
    item.estimate = record.get("step_estimate", {})
    item.verdict = "fits" if result.fits else ("refused" if result.error else "does not fit")


def best(tried: list[Tried]) -> Tried | None:
    """The fastest candidate that fits, by useful tokens/s/chip (None when nothing fits)."""
    fitting = [t for t in tried if t.fits and t.estimate.get("reported")]
    return max(fitting, key=lambda t: t.speed) if fitting else None


def tuned_yaml(
    recipe_path: Path,
    out: Path,
    recipe: Recipe,
    device: Device,
    chosen: Tried,
    baseline: Tried,
    given: Sequence[str] = (),
) -> str:
    """The tuned recipe: ``extends`` the original, sets the overrides tune was ``given`` (every candidate was
    compiled with them), the target it was tuned for where the original names none or another, and what
    changed, and says why in its header."""
    given = _portable(given)
    target = [f"runtime.target={device.name}"] if recipe.runtime.target != device.name else []
    changes = given + target
    changes += [
        o for o in chosen.candidate.overrides(device.devices) if o not in baseline.candidate.overrides(device.devices)
    ]
    lines = [
        f"# {recipe_path.name} tuned for {device.name} by `lowmem-tpu tune` (libtpu's cost model, per chip):",
        f"#   chosen:   {chosen.candidate.describe()}",
        f"#             {_figures(chosen)}",
        f"#   original: {baseline.candidate.describe()}",
        f"#             {_figures(baseline)}",
        *([f"#   given:    {' '.join(given)}"] if given else []),
        "# Figures from the TPU compiler's program of the step, not a run; `lowmem-tpu memory THIS --compile`.",
        f"extends: {_parent(recipe_path, out)}",
    ]
    return "\n".join(lines + _nested(changes)) + "\n"


def _parent(recipe_path: Path, out: Path) -> str:
    """How the tuned recipe names the one it extends: a shipped recipe by its name (found wherever the package
    is, unless a file of that name lies beside the tuned recipe), any other by its path relative to it."""
    from lowmem_tpu.config import shipped_recipes

    resolved = recipe_path.resolve()
    shipped = shipped_recipes().get(resolved.stem)
    beside = out.parent / resolved.name
    if shipped is not None and shipped.resolve() == resolved and not beside.exists() and out.name != resolved.name:
        return resolved.name
    return os.path.relpath(resolved, out.parent.resolve())


def _portable(given: Sequence[str]) -> list[str]:
    """The overrides tune was given, less where it compiled (``runtime.device``): the recipe runs anywhere."""
    return [o for o in given if not o.startswith("runtime.device=")]


def _nested(overrides: list[str]) -> list[str]:
    """``section.key=value`` overrides as YAML mappings (a later one for the same key wins), values as given."""
    tree: dict[str, Any] = {}
    for override in overrides:
        key, value = override.split("=", 1)
        *path, name = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value

    def lines(node: dict[str, Any], indent: str) -> list[str]:
        out = []
        for name, value in node.items():
            if isinstance(value, dict):
                out += [f"{indent}{name}:", *lines(value, indent + "  ")]
            else:
                out.append(f"{indent}{name}: {value}")
        return out

    return lines(tree, "")


def _figures(t: Tried) -> str:
    if not t.estimate.get("reported"):
        return t.verdict
    e = t.estimate
    useful = f", {e['useful_tokens_per_second_per_chip']:,.0f} useful tokens/s" if e.get("fill") else ""
    step = "micro-step" if t.candidate.accumulation > 1 else "step"
    bound = f" ({e['bound_by']})" if e.get("bound_by", "compute") != "compute" else ""
    verdict = "" if t.fits else " (does not fit)"
    return (
        f"{(t.needed or 0) / 2**30:.2f} GiB{verdict}, {step} {e['step_seconds'] * 1e3:.0f} ms{bound}, "
        f"MFU {e.get('mfu', 0):.0%}, {e['tokens_per_second_per_chip']:,.0f} tokens/s{useful}"
    )


def row(t: Tried) -> str:
    """One line of the table ``tune`` prints."""
    planned = f"{t.planned / 2**30:5.2f}" if t.planned is not None else "    -"
    return f"{t.candidate.describe():<62} plan {planned} GiB  {_figures(t) if t.estimate else t.verdict}"


def tune_json(
    tried: list[Tried], fills: dict[bool, float | None], source: str, device: Device, given: Sequence[str] = ()
) -> dict[str, Any]:
    """What ``tune`` writes beside the recipe: the overrides it was given, every candidate, its plan, verdict and
    estimate."""
    from dataclasses import asdict

    return {
        "target": device.name,
        "overrides": _portable(given),
        "fill": {"padded": fills[False], "packed": fills[True], "source": source},
        "tried": [
            {"settings": asdict(t.candidate)} | {k: v for k, v in vars(t).items() if k != "candidate"} for t in tried
        ],
    }
