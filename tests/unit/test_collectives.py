# ruff: noqa: E501  (HLO instructions are written on one line each, as libtpu prints them)
"""What a step moves over the interconnect, read off optimized HLO (measure.collectives), and the step estimate
that counts it beside libtpu's cycles and HBM (measure.tpu_report.step_estimate)."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.measure.collectives import Collective, collectives, gathered_by_dtype, received_by_kind
from lowmem_tpu.measure.hlo_cost import step_cost
from lowmem_tpu.measure.tpu_compile import MARGIN, TpuCompile, program_cost
from lowmem_tpu.measure.tpu_report import step_estimate

# libtpu's program for the tiny recipe with flash attention on v5e-8 (tools/make_hlo_fixture.py writes it).
REAL = Path(__file__).resolve().parents[1] / "helpers" / "libtpu" / "tiny_flash_v5e8.hlo.gz"

# A program in the shape libtpu writes one: an all-gather split into phases (the start fusion, a phase and
# the done fusion each hold a copy, one channel), a windowed loop of 3 trips whose body permutes a block,
# and an all-reduce of two adapters' gradients over 4 chips.
PROGRAM = """HloModule step

%gather_start (param_0: bf16[128,64]) -> bf16[1024,64] {
  %param_0 = bf16[128,64]{1,0} parameter(0)
  ROOT %all-gather.1 = bf16[1024,64]{1,0} all-gather(%param_0), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%gather_phase (param_0.1: bf16[128,64]) -> bf16[1024,64] {
  %param_0.1 = bf16[128,64]{1,0:S(1)} parameter(0)
  ROOT %all-gather.2 = bf16[1024,64]{1,0:S(1)} all-gather(%param_0.1), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%gather_done (param_0.2: bf16[128,64]) -> bf16[1024,64] {
  %param_0.2 = bf16[128,64]{1,0} parameter(0)
  ROOT %all-gather.3 = bf16[1024,64]{1,0} all-gather(%param_0.2), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

%body (wide.param: (f32[16,32], u32[])) -> (f32[16,32], u32[]) {
  %wide.param = (f32[16,32]{1,0}, u32[]) parameter(0)
  %get-tuple-element.1 = f32[16,32]{1,0} get-tuple-element(%wide.param), index=0
  %get-tuple-element.2 = u32[] get-tuple-element(%wide.param), index=1
  %collective-permute-start.1 = (f32[16,32]{1,0}, f32[16,32]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%get-tuple-element.1), channel_id=9, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %collective-permute-done.1 = f32[16,32]{1,0} collective-permute-done(%collective-permute-start.1)
  %constant.1 = u32[] constant(1)
  %add.1 = u32[] add(%get-tuple-element.2, %constant.1)
  ROOT %tuple.1 = (f32[16,32]{1,0}, u32[]) tuple(%collective-permute-done.1, %add.1)
}

%cond (wide.param.1: (f32[16,32], u32[])) -> pred[] {
  %wide.param.1 = (f32[16,32]{1,0}, u32[]) parameter(0)
  %get-tuple-element.3 = u32[] get-tuple-element(%wide.param.1), index=1
  %constant.2 = u32[] constant(3)
  ROOT %compare.1 = pred[] compare(%get-tuple-element.3, %constant.2), direction=LT
}

ENTRY %main (p0: bf16[128,64], p1: f32[16,32], p2: f32[16,64], p3: f32[64,16]) -> f32[16,32] {
  %p0 = bf16[128,64]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  %p2 = f32[16,64]{1,0} parameter(2)
  %p3 = f32[64,16]{1,0} parameter(3)
  %fusion.1 = bf16[1024,64]{1,0} fusion(%p0), kind=kLoop, calls=%gather_start
  %fusion.2 = bf16[1024,64]{1,0:S(1)} fusion(%p0), kind=kLoop, calls=%gather_phase
  %fusion.3 = bf16[1024,64]{1,0} fusion(%p0), kind=kLoop, calls=%gather_done
  %all-reduce.1 = (f32[16,64]{1,0}, f32[64,16]{1,0}) all-reduce(%p2, %p3), channel_id=11, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %constant.0 = u32[] constant(0)
  %tuple.0 = (f32[16,32]{1,0}, u32[]) tuple(%p1, %constant.0)
  %while.1 = (f32[16,32]{1,0}, u32[]) while(%tuple.0), condition=%cond, body=%body
  ROOT %get-tuple-element.4 = f32[16,32]{1,0} get-tuple-element(%while.1), index=0
}
"""


def test_each_logical_collective_is_counted_once_per_run_with_what_a_chip_receives():
    found = {c.kind: c for c in collectives(PROGRAM, 8)}
    assert found == {
        "all-gather": Collective("all-gather", 1024 * 64 * 2, 8, 1, "bf16"),  # three copies, one channel
        "collective-permute": Collective("collective-permute", 16 * 32 * 4, 8, 3, "f32"),  # the loop's 3 trips
        "all-reduce": Collective("all-reduce", (16 * 64 + 64 * 16) * 4, 4, 1, "f32"),  # groups of 4
    }
    received = received_by_kind(list(found.values()))
    assert received == {
        "all-gather": 7 / 8 * 1024 * 64 * 2,
        "all-reduce": 2 * 3 / 4 * (16 * 64 + 64 * 16) * 4,  # a reduce-scatter, then an all-gather
        "collective-permute": 3 * 16 * 32 * 4,  # each run sends and receives its block
    }
    assert gathered_by_dtype(list(found.values())) == {"bf16": 1024 * 64 * 2}


def test_the_real_program_counts_each_channel_once_and_each_kernel_by_its_runs():
    """libtpu's own program: its all-gathers are split into phases (one channel held by many fused copies)."""
    text = gzip.decompress(REAL.read_bytes()).decode()
    copies: dict[str, int] = {}
    for line in text.splitlines():
        if re.search(r" (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(", line):
            channel = re.search(r"channel_id=(\d+)", line).group(1)
            copies[channel] = copies.get(channel, 0) + 1
    found = collectives(text, 8)
    assert len(found) == len(copies) and max(copies.values()) > 4  # a chain of copies, counted once
    assert {c.kind for c in found} >= {"all-gather", "all-reduce"} and all(c.group == 8 for c in found)
    kernels = {k.name: k.runs for k in step_cost(text).kernels}
    # The forward kernel twice (the layer and its recomputation under checkpointing), each backward kernel once.
    assert kernels == {
        "_flash_attention_kernel_single_batch_single_step": 2,
        "_flash_attention_dq_kernel": 1,
        "_flash_attention_dkv_kernel": 1,
    }


def _compiled(step: dict, device: str = "v5e-8", **figures: int) -> TpuCompile:
    d = DEVICES[device]
    return TpuCompile(device, d.topology or "", d.devices, d.hbm_bytes, "0.0.21", "TPU v5 lite", 0.0, 0.0, 0, 0, 0, step=step, **figures)  # fmt: skip


def test_the_estimate_times_the_interconnect_beside_compute_and_hbm_and_takes_the_largest(tmp_path):
    program = tmp_path / "tpu.hlo.txt"
    program.write_bytes(gzip.decompress(REAL.read_bytes()))
    step = program_cost(program, 8)["step"]
    received = sum(step["received"].values())
    cost = step_estimate(_compiled(step), None, 2048, None)
    assert cost["ici_bytes_per_chip"] == received > 0
    assert cost["ici_bytes_per_second"] == DEVICES["v5e-8"].ici_in_bandwidth == 100e9  # 2 of a corner's 4 ports
    assert cost["ici_seconds"] == pytest.approx(received / 100e9)
    times = {"compute": cost["compute_seconds"], "interconnect": cost["ici_seconds"], "HBM": cost["hbm_seconds"]}
    assert cost["step_seconds"] == max(times.values()) and cost["bound_by"] == max(times, key=times.get)
    assert cost["sum_seconds"] == pytest.approx(sum(times.values()))
    assert cost["kernel_seconds"] > 0  # the kernels carry no cycles: costed from their shapes, once each
    # A program that moves twice as much over the interconnect as it computes is bound by it.
    heavy = step | {"received": {"all-gather": 2 * cost["compute_seconds"] * 100e9}}
    assert step_estimate(_compiled(heavy), None, 2048, None)["bound_by"] == "interconnect"
    one_chip = step_estimate(_compiled(step | {"received": {}}, "v5e-1"), None, 2048, None)
    assert one_chip["ici_seconds"] == 0 and "ici_unknown" not in one_chip


def test_a_program_fits_with_a_gib_free_beside_its_code_and_its_lines_error():
    usable = DEVICES["v5e-8"].hbm_bytes
    buffers = usable - MARGIN - 2**28
    assert _compiled({}, temporaries=buffers).fits  # a quarter GiB to spare beside the kept GiB
    assert not _compiled({}, temporaries=buffers, generated_code=2**29).fits  # its code is in HBM too
    extrapolated = _compiled({}, temporaries=buffers, line_error=0.02)  # 2% of 14.5 GiB: more than the spare
    assert extrapolated.held == buffers + round(0.02 * buffers) and not extrapolated.fits
    assert _compiled({}, temporaries=buffers).free == MARGIN + 2**28


def test_the_lines_error_kept_as_margin_covers_every_check_of_the_line():
    """measure.tpu_layers.LINE_ERROR against benchmarks/results/line_check.json (tools/tpu_compile_recipes.py
    --line-check): the line through the cut compiles, against compiles at more layers or whole."""
    import json

    from lowmem_tpu.measure.tpu_layers import LINE_ERROR

    checks = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/line_check.json").read_text())
    assert checks and all(abs(c["held"][2]) <= LINE_ERROR for c in checks.values())
    assert any(abs(c["held"][2]) > LINE_ERROR / 2 for c in checks.values())  # not a bound far above what was seen
