"""A step too large to compile here, compiled at 2 and 4 decoder layers and extrapolated (said so).

libtpu's host RAM grows with the program's per-chip buffers (Open Llama 3B's LoRA step on one v5e
chip: 20.2 GiB), so a 7B or 70B step can need more than a small machine has. The traced step is
unrolled, one copy per decoder layer, so each figure of a chip (arguments, outputs, aliased,
temporaries) is a fixed part plus the same amount per layer: the line through the 2- and 4-layer
compiles of the same recipe gives its figures at the recipe's layer count. On Open Llama 3B
(26 layers) the line lands within 1% of the whole compile (docs/tpu_compiler.md, "Compiled at fewer layers").
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from lowmem_tpu.config import Recipe, with_overrides
from lowmem_tpu.config.devices import Device
from lowmem_tpu.config.features import TOWERS
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.tpu_compile import (
    CompileTooLong,
    HostMemoryExhausted,
    TpuCompile,
    TracedStep,
    compile_recipe,
    compile_traced,
    trace_step,
)

LAYERS = (2, 4)
# How far the line through the cut compiles lands from a compile at more layers, at most, in what the chip
# holds (benchmarks/results/line_check.json: `python tools/tpu_compile_recipes.py --line-check ...`; a unit
# test holds this at or above every error recorded there). An extrapolated record keeps it as its margin.
LINE_ERROR = 0.02  # Llama 3.1 8B on v5e-8: the line +0.4% at 8 layers, +2.0% at 16 (above the compile: safe side)
WHOLE_LIMIT = 600.0  # seconds the whole step may compile here before 2 and 4 layers are compiled instead
# Figures that are a fixed part plus a part per layer; the rest (the target, the versions) are the points'.
LINEAR = ("arguments", "outputs", "aliased", "temporaries", "scratch", "host", "resident", "idle", "generated_code")
LINEAR_RUN = ("placeholders", "donated")


def layer_points(recipe: Recipe) -> tuple[int, int]:
    """The layer counts a cut step is compiled at: 2 and 4, or K and 2K where one layer in K is recomputed
    (``every_K``, K > 2), so that the layers between the two hold one recomputed layer in K as the whole model's
    do (at 2 and 4 layers with every_4 the two added layers are both kept: the line then puts the whole step
    over what it holds and faster than it runs)."""
    text = _text(_config(recipe))
    if text.get("num_kv_shared_layers"):
        return _shared_kv_points(text)
    every = recipe.sharding.checkpoint_every
    return (every, 2 * every) if every > 2 else LAYERS


def _shared_kv_points(text: dict[str, Any]) -> tuple[int, int]:
    """Gemma 4's cut: its last ``num_kv_shared_layers`` reuse earlier layers' K/V (no k/v projections, a
    wider MLP), so each cut keeps the whole model's share of them (E2B: 20 of 35 layers; cut at 14 and 28,
    8 and 16 reusing), and before them a producer of every layer kind they read."""
    total, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    unit = total // math.gcd(total, shared)
    for low in range(unit, total // 2 + 1, unit):
        if all(_kv_valid(text, n) for n in (low, 2 * low)):
            return low, 2 * low
    return total, total  # no smaller cut keeps the layers' mix: compiled whole


def _kv_valid(text: dict[str, Any], layers: int) -> bool:
    kinds = text.get("layer_types") or []
    reused = layers * text["num_kv_shared_layers"] // text["num_hidden_layers"]
    producers = set(kinds[: layers - reused])
    return not reused or set(kinds[layers - reused : layers]) <= producers


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def layers_of(recipe: Recipe) -> int:
    return int(_text(_config(recipe))["num_hidden_layers"])


def cut(recipe: Recipe, layers: int, work: Path) -> Recipe:
    """The recipe on a copy of its model's config with ``layers`` decoder layers (a config only: no weights).

    A multimodal config's text decoder is cut; a per-layer attention list (Gemma's ``layer_types``) keeps
    its first ``layers`` entries, Gemma 4's shared-K/V layers their share (``_shared_kv_points``).
    """
    config = _config(recipe)
    text = dict(_text(config))
    if text.get("num_kv_shared_layers"):  # the cut keeps the whole model's share of reusing layers
        text["num_kv_shared_layers"] = layers * text["num_kv_shared_layers"] // text["num_hidden_layers"]
    if isinstance(text.get("per_layer_config"), dict):  # a saved config's per-layer overrides, by index
        text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < layers}
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
        if text.get("num_kv_shared_layers"):
            _last_layer_full(text)
    config = config | {"text_config": text} if "text_config" in config else text
    where = work / f"layers-{layers}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    return with_overrides(recipe, [f"model.name_or_path={where}"])


def _last_layer_full(text: dict[str, Any]) -> None:
    """Gemma 4's last layer is a full-attention one (its config class makes it so): the cut's too, with the
    per-layer settings of the full layers."""
    kinds, per = text["layer_types"], text.get("per_layer_config")
    if kinds[-1] == "full_attention":
        return
    kinds[-1] = "full_attention"
    full = next((k for k in per or {} if kinds[int(k)] == "full_attention" and int(k) < len(kinds) - 1), None)
    if full is not None:
        per[str(len(kinds) - 1).zfill(len(full))] = per[full]


def trace_cut(recipe: Recipe, device: Device, layers: int, work: Path, timeout: float) -> TracedStep:
    return trace_step(cut(recipe, layers, work), device, work / f"trace-{layers}", timeout)


def extrapolate(points: dict[int, TpuCompile], layers: int) -> TpuCompile:
    """The figures at ``layers`` on the line through two compiles at fewer layers.

    A point the compiler refused (or failed) is returned as it is: a step that does not fit at 4
    layers does not fit at more, and its figures are the refusal's.
    """
    (low, a), (high, b) = sorted(points.items())
    if a.refused or a.error or b.refused or b.error:
        return replace(b, extrapolated_from=(low, high))
    share = (layers - low) / (high - low)

    def at(name: str) -> Any:
        x, y = getattr(a, name), getattr(b, name)
        return type(y)(round(x + (y - x) * share, 2) if isinstance(y, float) else round(x + (y - x) * share))

    cost = {k: a.cost[k] + (v - a.cost[k]) * share for k, v in b.cost.items() if k in a.cost}
    step = extrapolate_step(a.step, b.step, share)
    gathered = _line(a.gathered, b.gathered, share)
    linear = {f.name: at(f.name) for f in fields(TpuCompile) if f.name in (*LINEAR, *LINEAR_RUN)}
    spent = {  # what this command took: both compiles
        "trace_seconds": a.trace_seconds + b.trace_seconds,
        "compile_seconds": a.compile_seconds + b.compile_seconds,
        "host_peak_rss_bytes": max(a.host_peak_rss_bytes, b.host_peak_rss_bytes),
    }
    return replace(
        b,
        **linear,
        **spent,
        cost=cost,
        step=step,
        gathered=gathered,
        extrapolated_from=(low, high),
        line_error=LINE_ERROR,
    )


def extrapolate_step(a: dict[str, Any], b: dict[str, Any], share: float) -> dict[str, Any]:
    """The step's cost (``TpuCompile.step``) on the line: its sums and each kernel's runs per step."""
    if not a or not b:
        return {}
    out = {k: type(v)(round(a[k] + (v - a[k]) * share)) for k, v in b.items() if isinstance(v, int | float)}
    out["received"] = _line(a.get("received", {}), b.get("received", {}), share)
    runs = {_kernel_key(k): k["runs"] for k in a.get("kernels", [])}
    out["kernels"] = [
        k | {"runs": round(runs.get(_kernel_key(k), 0) + (k["runs"] - runs.get(_kernel_key(k), 0)) * share)}
        for k in b.get("kernels", [])
    ]
    return out


def _line(a: dict[str, float], b: dict[str, float], share: float) -> dict[str, float]:
    """Each figure of ``b`` on the line from ``a`` (one absent from ``a`` starts at 0)."""
    return {k: round(a.get(k, 0) + (v - a.get(k, 0)) * share) for k, v in b.items()}


def _kernel_key(kernel: dict[str, Any]) -> str:
    return json.dumps([kernel["name"], kernel["shapes"], kernel["hbm_bytes"]])


def compile_points(recipe: Recipe, device: Device, work: Path, timeout: float = 3600) -> dict[int, TpuCompile]:
    """The recipe's step compiled at each of its :func:`layer_points`."""
    layers = layers_of(recipe)
    if layers <= layer_points(recipe)[-1]:
        raise UserError(f"the model has {layers} layers: compile it whole (nothing to extrapolate)")
    points = {}
    for n in layer_points(recipe):
        traced = trace_cut(recipe, device, n, work, timeout)
        points[n] = compile_traced(traced, device, work / f"compile-{n}", timeout)
    return points


def compile_by_layers(recipe: Recipe, device: Device, work: Path, timeout: float = 3600) -> TpuCompile:
    """The recipe compiled at its :func:`layer_points` and extrapolated to its own layer count."""
    return extrapolate(compile_points(recipe, device, work, timeout), layers_of(recipe))


def compile_or_extrapolate(
    recipe: Recipe, device: Device, timeout: float = 3600, whole_limit: float = WHOLE_LIMIT
) -> TpuCompile:
    """The whole step compiled; if this machine's RAM runs out under the compiler, or the whole compile takes
    over ``whole_limit`` seconds (an 8B step takes over 20 minutes here), 2 and 4 layers extrapolated."""
    few = layers_of(recipe) <= layer_points(recipe)[-1]
    try:
        return compile_recipe(recipe, device, timeout if few else min(timeout, whole_limit))
    except (HostMemoryExhausted, CompileTooLong) as err:
        if few:
            raise
        low, high = layer_points(recipe)
        layers = f"{low} and {high} layers instead, extrapolated to {layers_of(recipe)}"
        print(f"{err}\ncompiling {layers}...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="lowmem-tpu-layers-") as tmp:
        return compile_by_layers(recipe, device, Path(tmp), timeout)


def _config(recipe: Recipe) -> dict[str, Any]:
    from lowmem_tpu.model.build import require_config

    config = require_config(recipe)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {key: value for key, value in raw.items() if key != TOWERS}  # ours, not the model's
