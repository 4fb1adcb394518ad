# ruff: noqa: E501  (HLO instructions are written on one line each, as libtpu prints them)
"""The step's cost read off an optimized HLO program: libtpu's cycle estimates, matmul flops and HBM
bytes, each loop followed its trip count (measure.hlo_cost)."""

from __future__ import annotations

from lowmem_tpu.measure.hlo_cost import step_cost
from lowmem_tpu.measure.hlo_text import arrays, parse, trip_count

# A program in the shape libtpu writes it: a windowed-einsum-like loop (counter from a copied constant 0,
# stepped by 2, LT 6: 3 trips) whose body runs one matmul fusion, and a batched matmul written as a
# convolution over a window dilated by as much (one multiply-add per output per position, not 4).
PROGRAM = """HloModule step, entry_computation_layout={(f32[8,16]{1,0})->f32[8,4]{1,0}}

%fused_matmul (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,4]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%fused_batched (param_0.2: bf16[4,8,16], param_1.2: bf16[4,16,8]) -> bf16[4,8,8] {
  %param_0.2 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1.2 = bf16[4,16,8]{2,1,0} parameter(1)
  ROOT %convolution.2 = bf16[4,8,8]{2,1,0} convolution(%param_0.2, %param_1.2), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0io->0bf
}

%body (wide.param: (f32[8,16], f32[16,4], u32[])) -> (f32[8,16], f32[16,4], u32[]) {
  %wide.param = (f32[8,16]{1,0}, f32[16,4]{1,0:S(1)}, u32[]) parameter(0)
  %get-tuple-element.1 = f32[8,16]{1,0} get-tuple-element(%wide.param), index=0
  %get-tuple-element.2 = f32[16,4]{1,0:S(1)} get-tuple-element(%wide.param), index=1
  %get-tuple-element.3 = u32[] get-tuple-element(%wide.param), index=2
  %fusion.1 = f32[8,4]{1,0} fusion(%get-tuple-element.1, %get-tuple-element.2), kind=kOutput, calls=%fused_matmul, backend_config={"window_config":{"estimated_cycles":"100"}}
  %constant.2..sunk = u32[] constant(2)
  %add.1 = u32[] add(%get-tuple-element.3, %constant.2..sunk)
  ROOT %tuple.2 = (f32[8,16]{1,0}, f32[16,4]{1,0:S(1)}, u32[]) tuple(%get-tuple-element.1, %get-tuple-element.2, %add.1)
}

%cond (wide.param.1: (f32[8,16], f32[16,4], u32[])) -> pred[] {
  %wide.param.1 = (f32[8,16]{1,0}, f32[16,4]{1,0:S(1)}, u32[]) parameter(0)
  %get-tuple-element.4 = u32[] get-tuple-element(%wide.param.1), index=2
  %constant.6 = u32[] constant(6)
  ROOT %compare.1 = pred[] compare(%get-tuple-element.4, %constant.6), direction=LT
}

ENTRY %main (p0: f32[8,16], p1: bf16[4,8,16], p2: bf16[4,16,8]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = bf16[4,8,16]{2,1,0} parameter(1)
  %p2 = bf16[4,16,8]{2,1,0} parameter(2)
  %weights = f32[16,4]{1,0:S(1)} constant({...})
  %constant.0 = u32[] constant(0)
  %copy.0 = u32[] copy(%constant.0)
  %tuple.1 = (f32[8,16]{1,0}, f32[16,4]{1,0:S(1)}, u32[]) tuple(%p0, %weights, %copy.0)
  %while.1 = (f32[8,16]{1,0}, f32[16,4]{1,0:S(1)}, u32[]) while(%tuple.1), condition=%cond, body=%body
  %fusion.2 = bf16[4,8,8]{2,1,0} fusion(%p1, %p2), kind=kOutput, calls=%fused_batched, backend_config={"window_config":{"estimated_cycles":"40"}}
  %copy.1 = bf16[4,8,8]{2,1,0} copy(%fusion.2), backend_config={"window_config":{"estimated_cycles":"7"}}
  ROOT %get-tuple-element.5 = f32[8,16]{1,0} get-tuple-element(%while.1), index=0
}
"""


def test_a_loop_runs_its_trip_count_read_off_its_counter():
    computations, entry = parse(PROGRAM)
    loop = computations[entry]["while.1"]
    assert trip_count(computations, computations[entry], loop) == 3  # from 0, by 2, while < 6


def test_cycles_sum_libtpus_estimates_with_trip_counts():
    cost = step_cost(PROGRAM)
    assert cost.cycles == 3 * 100 + 40 + 7
    assert cost.loops == 1 and cost.loops_unresolved == 0


def test_flops_count_each_matmul_once_per_run_and_a_dilated_window_once_per_output():
    cost = step_cost(PROGRAM)
    loop_matmul = 2 * 8 * 4 * 16  # [8,16] x [16,4]
    batched = 2 * 4 * 8 * 8 * 16  # 4 batches of [8,16] x [16,8]: the window of 4 over an input dilated by 4 meets 1
    assert cost.flops == 3 * loop_matmul + batched
    assert cost.flops_once == loop_matmul + batched  # as XLA's cost analysis counts a loop body


def test_hbm_bytes_leave_on_chip_operands_out():
    cost = step_cost(PROGRAM)
    loop_fusion = 8 * 16 * 4 + 8 * 4 * 4  # the S(1) weights are on-chip: not HBM traffic
    batched = 2 * (4 * 8 * 16 * 2) + 4 * 8 * 8 * 2
    copy = 2 * (4 * 8 * 8 * 2)
    assert cost.hbm_bytes == 3 * loop_fusion + batched + copy


def test_a_buffer_updated_in_place_is_not_counted_whole():
    """A windowed all-gather's destination, aliased to its operand, is written where it lands, not read and
    written whole on each trip; the fusion's other operand and output are."""
    fused = (
        "  %fusion.3 = (f32[8,4]{1,0}, bf16[64,16]{1,0}) fusion(%p0, %gathered), kind=kOutput, "
        "output_to_operand_aliasing={{1}: (1, {})}, calls=%fused_matmul, "
        'backend_config={"window_config":{"estimated_cycles":"9"}}\n'
    )
    program = PROGRAM.replace(
        "  %weights = ",
        "  %gathered = bf16[64,16]{1,0} parameter(3)\n" + fused + "  %weights = ",
    ).replace("p2: bf16[4,16,8]) -> f32[8,4]", "p2: bf16[4,16,8], p3: bf16[64,16]) -> f32[8,4]")
    added = step_cost(program).hbm_bytes - step_cost(PROGRAM).hbm_bytes
    assert added == 8 * 16 * 4 + 8 * 4 * 4  # p0 read, the f32 output written; the bf16[64,16] buffer left out


def test_an_operand_a_fusion_only_slices_is_read_where_it_is_sliced():
    sliced = (
        "%fused_slice (param_0.9: bf16[64,16]) -> bf16[8,16] {\n"
        "  %param_0.9 = bf16[64,16]{1,0} parameter(0)\n"
        "  ROOT %slice.9 = bf16[8,16]{1,0} slice(%param_0.9), slice={[0:8], [0:16]}\n"
        "}\n\n"
    )
    fusion = (
        "  %fusion.9 = bf16[8,16]{1,0} fusion(%stack), kind=kLoop, calls=%fused_slice, "
        'backend_config={"window_config":{"estimated_cycles":"3"}}\n'
    )
    program = (
        (sliced + PROGRAM)
        .replace("  %weights = ", "  %stack = bf16[64,16]{1,0} parameter(3)\n" + fusion + "  %weights = ")
        .replace("p2: bf16[4,16,8]) -> f32[8,4]", "p2: bf16[4,16,8], p3: bf16[64,16]) -> f32[8,4]")
    )
    added = step_cost(program).hbm_bytes - step_cost(PROGRAM).hbm_bytes
    assert added == 2 * (8 * 16 * 2)  # the slice read and written, not the [64,16] stack


def test_an_unreadable_loop_is_counted_once_and_said_so():
    program = PROGRAM.replace("direction=LT", "direction=NE")
    cost = step_cost(program)
    assert cost.loops_unresolved == 1 and cost.cycles == 100 + 40 + 7


def test_arrays_read_element_types_dims_and_memory_space():
    found = arrays("(bf16[4,1024]{1,0:T(8,128)(2,1)S(1)}, f32[]{:T(128)}, u8[3]{0})")
    assert found == [("bf16", (4, 1024), 1), ("f32", (), 0), ("u8", (3,), 0)]


def test_a_windowed_einsums_shard_meets_one_element_per_output():
    # libtpu's form of one 2-way shard of a projection: a window of 2 over a dimension of 1, padded by 1
    # on each side (each output meets one real element, so [4096, 3200] x [3200, 2 x 400], not twice that).
    program = """HloModule shard

ENTRY %main (x: bf16[4,1024,3200,1], w: bf16[2,400,3200,1]) -> bf16[4,1024,2,400] {
  %x = bf16[4,1024,3200,1]{3,2,1,0} parameter(0)
  %w = bf16[2,400,3200,1]{3,2,1,0} parameter(1)
  ROOT %convolution.813 = bf16[4,1024,2,400]{3,2,1,0} convolution(%x, %w), window={size=1x2 pad=0_0x1_1 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}
"""
    assert step_cost(program).flops == 2 * 4 * 1024 * 3200 * 2 * 400
