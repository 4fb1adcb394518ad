"""What a training run records about its memory per device: the plan for the devices it found,
beside what those devices report (HBM on a TPU; the CPU backend keeps no allocator statistics).

Imports no torch: ``sft`` passes the model's config and the runtime's plain figures.
"""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.devices import DEVICES, device_for, find_device, generation_of
from lowmem_tpu.errors import UserError
from lowmem_tpu.machine import host_memory
from lowmem_tpu.memory.plan import Plan, plan_setting
from lowmem_tpu.memory.shape import setting_of, shape_of

GiB = 2**30
NOT_MEASURED_ON_CPU = (
    "the CPU backend keeps no allocator statistics; `lowmem-tpu compare` and `lowmem-tpu memory` read the "
    "CPU compiler's own figure for the step"
)


def capacity_for(recipe: Recipe, platform: str, kind: str, devices: int) -> int:
    """Memory per device of what the run found: the TPU's usable HBM, or this host's RAM split over the devices."""
    if platform != "TPU":
        return find_device("cpu", devices, host_memory()).hbm_bytes
    generation = generation_of(kind)
    found = device_for(generation.name, devices) if generation else None
    target = found or DEVICES.get(recipe.runtime.target or "")
    return target.hbm_bytes if target else (generation.usable_bytes if generation else 0)


def run_plan(recipe: Recipe, config: Any, platform: str, kind: str, devices: int) -> Plan | None:
    """The planner's figures for this run on the devices it found (None for an architecture it does not model)."""
    try:
        shape, setting = shape_of(config), setting_of(recipe, devices)
    except (UserError, AttributeError, TypeError):
        return None
    layout = "tpu" if platform == "TPU" else "cpu"
    return plan_setting(shape, setting, layout, capacity_for(recipe, platform, kind, devices))


def memory_record(plan: Plan | None, per_device: list[dict[str, int]], platform: str) -> dict[str, Any]:
    """``metrics.json``'s ``memory``: planned and measured per device, in GiB, each with where it came from."""
    record: dict[str, Any] = {"per_device_bytes": {}, "planned_by": None, "measured_by": None}
    figures = record["per_device_bytes"]
    if plan is not None:
        figures |= {"planned_peak": plan.peak, "planned_with_margin": plan.needed, "device_memory": plan.capacity}
        record["planned_by"] = f"lowmem_tpu.memory planner, {plan.layout} layout"
    if per_device:
        figures |= {
            "measured_peak": max(d["peak"] for d in per_device),
            "measured_in_use_at_end": max(d["used"] for d in per_device),
        }
        record["measured_by"] = "libtpu runtime metrics (HBM in use per device, sampled every 0.25 s: the peak sampled)"
        record["devices"] = per_device
    elif platform != "TPU":
        record["not_measured"] = NOT_MEASURED_ON_CPU
    else:
        record["not_measured"] = "libtpu's runtime metrics were not readable (see `lowmem-tpu doctor`)"
    record["per_device_gib"] = {key: round(value / GiB, 4) for key, value in figures.items()}
    return record
