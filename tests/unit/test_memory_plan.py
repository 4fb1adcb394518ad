"""The memory planner (pure arithmetic, fast), its command line and the compiler's buffer assignment read
back (the real measurements, the CPU compiler on the tiny recipe: e2e/test_memory.py)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runs import memory_cli as cli

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.model_fields import LORA_TARGETS
from lowmem_tpu.errors import UserError
from lowmem_tpu.measure.buffers import live_at_peak, parse_buffer_assignment
from lowmem_tpu.measure.local import numel_per_device
from lowmem_tpu.memory import advise as memory_report
from lowmem_tpu.memory import cpu_layout, shape, tpu_layout
from lowmem_tpu.memory import plan as memory
from lowmem_tpu.model.build import require_config
from lowmem_tpu.xla.tpu import default_device

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "torch_xla", "transformers", "trl", "peft", "datasets")
# A small Llama whose every size is distinct, so a mixed-up dimension shows.
CONFIG = SimpleNamespace(
    hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, vocab_size=100
)
SHAPE = shape.shape_of(CONFIG)
BASE = shape.Setting(
    lora=False,
    rank=8,
    targets=LORA_TARGETS,
    lora_dropout=0.0,
    dtype="float32",
    strategy="fsdp",
    checkpointing=True,
    global_batch=8,
    accumulation=1,
    length=32,
    optimizer="adamw",
    fused_head=False,
    devices=4,
)
GiB = 2**30


def plan(st: shape.Setting = BASE, layout: str = "tpu", capacity: int = GiB) -> memory.Plan:
    return memory.plan_setting(SHAPE, st, layout, capacity)


# ----------------------------------------------------------------------------- components


def test_weights_gradients_and_adamw_state_follow_the_shard_rule():
    h, i, v, n = 64, 160, 100, 3
    # FSDP splits each tensor's largest dimension over 4 devices (ceil): embed and head [100, 64]
    # -> 25 rows; q/k/v/o [64, 64] -> 16 rows; gate/up [160, 64] and down [64, 160] -> 40; norms 16.
    per_layer = 4 * 16 * h + 3 * 40 * h + 2 * 16
    expected = (2 * 25 * h + 16 + n * per_layer) * 4
    p = plan(layout="cpu")
    assert p.weights == expected
    assert p.gradients == expected  # full fine-tuning: every weight trains, same dtype and sharding
    assert p.optimizer == 2 * expected  # AdamW: exp_avg and exp_avg_sq shaped like each parameter
    assert p.total_parameters == p.trainable_parameters == 2 * v * h + h + n * (4 * h * h + 3 * h * i + 2 * h)
    # A TPU holds each shard padded to (8, 128) tiles, whichever way round pads less: [25, 64] -> [32, 128],
    # [16, 64] -> [16, 128], [40, 64] and [64, 40] -> 40 x 128; vectors of 16 -> 128 elements.
    tiled = (2 * 32 * 128 + 128 + n * (4 * 16 * 128 + 3 * 40 * 128 + 2 * 128)) * 4
    tpu = plan()
    assert tpu.weights == tpu.gradients == tiled and tpu.optimizer == 2 * tiled


def test_lora_trains_fp32_adapters_on_a_bf16_base():
    st = replace(BASE, lora=True, dtype="bfloat16")
    p = plan(st)
    r, h, i, n = 8, 64, 160, 3
    adapters = n * (4 * r * (h + h) + 3 * r * (h + i))
    assert p.trainable_parameters == adapters
    assert p.total_parameters == plan(replace(BASE, dtype="bfloat16")).total_parameters + adapters
    assert p.optimizer == 2 * p.gradients  # adapters in fp32: 4 bytes for each state
    assert p.weights < plan(replace(BASE, dtype="float32", lora=True)).weights  # the base in bf16


def test_adafactor_keeps_factored_fp32_state():
    adamw, adafactor = plan(), plan(replace(BASE, optimizer="adafactor"))
    assert adafactor.optimizer < adamw.optimizer / 10
    # [100, 64] embedding split on rows: its row factor (100) is split 4 ways, its column factor (64) is not.
    one = memory.optimizer_bytes([memory.Tensor((100, 64), 4, True)], replace(BASE, optimizer="adafactor"))
    assert one == (25 + 64) * 4


def test_replicated_keeps_a_full_copy_per_device():
    fsdp, replicated = plan(layout="cpu"), plan(replace(BASE, strategy="replicated"), layout="cpu")
    assert replicated.weights > 3.5 * fsdp.weights
    assert replicated.workspace == plan(replace(BASE, strategy="replicated")).workspace == 0  # nothing gathered


def test_activations_with_and_without_checkpointing():
    st = BASE
    layer = cpu_layout.layer_activations(SHAPE, st)
    tokens = 2 * 32  # 8 sequences over 4 devices, 32 tokens each
    assert layer == tokens * (8 * 64 + 5 * 160) * 4 + 2 * 4 * 32 * 32 * 4
    assert cpu_layout.activations(SHAPE, replace(st, checkpointing=False), "tpu") == 3 * layer
    assert cpu_layout.activations(SHAPE, st, "tpu") == 4 * tokens * 64 * 4 + layer
    p = plan()
    assert p.activations_checkpointed < p.activations_not_checkpointed
    assert p.activations == p.activations_checkpointed
    # LoRA on gate and up keeps two more intermediate-sized tensors per layer.
    lora = replace(st, lora=True)
    assert cpu_layout.layer_activations(SHAPE, lora) - layer == tokens * 2 * 160 * 4


def test_logits_full_or_chunked():
    full = cpu_layout.logits_bytes(SHAPE, BASE)
    assert full == 3 * 64 * 100 * 4  # logits, their fp32 copy and gradient
    chunked = cpu_layout.logits_bytes(SHAPE, replace(BASE, fused_head=True))
    assert chunked == 3 * math.ceil(8 * 31 / 4) * 32768 * 4  # TRL pads the vocabulary to its 32768-wide tile
    llama, long = replace(SHAPE, vocab=32000), replace(BASE, length=2048, global_batch=32)
    assert cpu_layout.logits_bytes(llama, replace(long, fused_head=True)) < cpu_layout.logits_bytes(llama, long) / 10


def test_peak_is_persistent_state_plus_the_larger_phase():
    p = plan(layout="cpu")
    backward = max(p.logits + p.workspace, cpu_layout.backward_workspace(SHAPE, BASE))
    assert p.peak == p.weights + p.optimizer + max(p.activations + backward, p.gradient_phase)
    assert p.margin == p.peak // 10 + 256 * 2**20
    assert p.persistent == p.weights + p.gradients + p.optimizer
    # No reduce-scatter on the CPU backend: whole gradients at the end of backward.
    whole = sum(t.numel * 4 for t in memory.parameters(SHAPE, BASE)) + 100 * 64 * 4  # + the LM head twice
    assert p.gradient_phase == whole + cpu_layout.layer_activations(SHAPE, BASE)


def test_the_tpu_layout_is_the_tpu_compilers():
    """What the TPU compiler keeps (tpu_layout): a logits buffer in the compute dtype (and its gradient beside
    it when full fine-tuning trains the sharded head), 2.0 hidden-sized tensors per checkpointed layer across
    chips (3.9 on one), the layer in hand with 2 fp32 MLP gradients (3 on one), the head and one layer gathered,
    and full fine-tuning's gradient copies held for the optimizer once the layers' backward runs."""
    st = replace(BASE, dtype="bfloat16", length=64)
    p, t = plan(st), tpu_layout.transients(SHAPE, st, 0)
    tokens = 2 * 64
    assert p.logits == t.logits == 2 * tokens * 100 * 2  # no fp32 copies: the loss is fused with the head
    assert plan(replace(st, lora=True)).logits == tokens * 100 * 2  # LoRA's frozen head needs no gradient of it
    assert t.kept == int(3 * 2.0 * tokens * 64 * 2)
    one = replace(st, devices=1, global_batch=2)
    assert tpu_layout.kept(SHAPE, one, True) == int(3 * 3.9 * tokens * 64 * 2)
    assert plan(one).logits == 2 * 64 * 100 * 2  # one chip: the head is not sharded, one buffer
    probabilities = 2 * 4 * 64 * 64 * 2  # [sequences, heads, length, length] in bf16
    assert t.layer == tokens * (9 * 64 + 160) * 2 + 2 * tokens * 160 * 4 + probabilities  # 2 fp32 MLP gradients
    assert p.workspace == (100 * 64 + 4 * 64 * 64 + 3 * 64 * 160) * 2 and plan(one).workspace == 0
    trained = sum(memory.shard_numel(x.shape, "fsdp", 4) for x in memory.parameters(SHAPE, st))
    assert p.gradient_phase == p.gradients + 5 * trained  # an fp32 copy of every gradient and part of the update
    loss_phase, layer_phase = t.kept + t.logits, t.kept + t.layer + 5 * trained  # no layer's gradient at the loss
    assert p.peak == p.weights + p.optimizer + p.gradients + max(loss_phase, layer_phase) + p.workspace
    lora = plan(replace(st, lora=True))
    assert lora.gradient_phase == lora.gradients  # LoRA: nothing copied
    # The chunked loss keeps two blocks of 8 positions (64 / 8) of logits.
    assert plan(replace(st, chunked_loss=True)).logits == 2 * 2 * 8 * 100 * 2


def test_fits_and_does_not_fit():
    p = plan(capacity=GiB)
    assert p.fits and p.needed <= GiB
    small = plan(capacity=p.needed - 1)
    assert not small.fits


# ----------------------------------------------------------------------------- suggestions and twin


def test_suggestions_turn_techniques_on_in_order_until_it_fits():
    llama = replace(SHAPE, vocab=32000)
    # LoRA: fully fine-tuned, this model (its embedding and head 97% of its 4.2 M parameters) is cheaper
    # replicated, its trained head then unsharded (one logits buffer, not two: tpu_layout.TRAINED_HEAD_LOGITS).
    worst = replace(BASE, lora=True, strategy="replicated", checkpointing=False, length=1024, global_batch=16)
    start = memory.plan_setting(llama, worst, "tpu", GiB)
    steps = memory_report.next_steps(llama, replace(start, capacity=start.needed // 8))
    names = [s.override for s in steps]
    # Cheapest first: sharding, then a smaller micro-batch with accumulation, before recomputation
    assert names[:2] == ["sharding.strategy=fsdp", "train.gradient_accumulation_steps=2"], names
    order = ["train.gradient_accumulation_steps", "train.chunked_loss", "model.attn_implementation", "sharding.act"]
    firsts = [next(i for i, n in enumerate(names) if n.startswith(o)) for o in order]
    assert firsts == sorted(firsts), names
    # Checkpointing comes one layer in two first, then every layer; never offload (it saves nothing on a TPU).
    checkpointing = [n for n in names if n.startswith("sharding.act")]
    assert checkpointing == ["sharding.activation_checkpointing=every_2", "sharding.activation_checkpointing=true"]
    assert not any("offload" in n for n in names)
    peaks = [start.peak] + [s.plan.peak for s in steps]
    assert all(b < a for a, b in itertools.pairwise(peaks))
    assert memory_report.next_steps(llama, replace(start, capacity=start.needed // 3))[-1].plan.fits
    # Pasted as one command line: one override per field, its last value.
    line = memory_report.together(steps).split()
    assert len(line) == len({o.split("=")[0] for o in names}) and "sharding.activation_checkpointing=true" in line
    assert [o for o in line if o.startswith("train.gradient_accumulation_steps")] == [
        [n for n in names if n.startswith("train.gradient_accumulation_steps")][-1]
    ]


def test_suggestions_stop_when_nothing_is_left():
    steps = memory_report.next_steps(SHAPE, plan(capacity=1))
    assert steps and not steps[-1].plan.fits
    known = {"train.optimizer=adafactor", "lora.enabled=true", "train.chunked_loss=true"}
    known |= {"train.gradient_accumulation_steps=2", "model.attn_implementation=chunked", "data.max_length=16"}
    known |= {"model.quantize=int8", "model.quantize=nf4"}
    assert {s.override for s in steps} <= known
    text = "\n".join(memory_report.format_plan("the recipe", plan(capacity=1), steps))
    assert "nothing left to turn on" in text


def test_plan_recipe_has_a_twin_and_the_shipped_configs():
    recipe = load_recipe(ROOT / "recipes/open_llama_lora.yaml")
    report = memory_report.plan_recipe(recipe, default_device(recipe), require_config(recipe))
    assert report.plan.setting.lora and not report.twin.setting.lora
    # runtime.target: Kaggle's v5e-8, 15.75 GiB usable per chip (what its compiler reports)
    assert report.device.name == "v5e-8" and report.device.devices == 8
    assert report.device.hbm_bytes == int(15.75 * GiB)
    assert 3.4e9 < report.twin.trainable_parameters < 3.5e9  # Open Llama 3B v2's exact architecture
    assert 25e6 < report.plan.trainable_parameters < 26e6
    assert report.plan.fits
    full = load_recipe(ROOT / "recipes/open_llama_full.yaml", ["model.name_or_path=openlm-research/open_llama_7b_v2"])
    seven = memory_report.plan_recipe(full, "v2-8", require_config(full))
    assert 6.7e9 < seven.plan.total_parameters < 6.8e9
    text = memory_report.format_report(report)
    assert "its twin (lora.enabled=false)" in text and "margin for XLA workspace" in text


def test_accumulation_and_chunked_attention_lower_the_planned_activations():
    one = replace(BASE, global_batch=16)
    four = replace(one, accumulation=4)
    assert four.sequences * 4 == one.sequences and four.live_sequences == four.sequences
    assert cpu_layout.activations(SHAPE, four, "tpu") < cpu_layout.activations(SHAPE, one, "tpu") / 3
    # On the CPU compiler a micro-batch program ending at its gradients loses checkpointing (measured):
    # every layer's per-token activations, one layer's attention scores
    off = cpu_layout.activations(SHAPE, replace(four, checkpointing=False), "cpu")
    scores = cpu_layout.attention_scores(SHAPE, four)
    assert cpu_layout.activations(SHAPE, four, "cpu") == off - (SHAPE.layers - 1) * scores
    long = replace(BASE, length=1024)
    eager, chunked = (cpu_layout.attention_scores(SHAPE, replace(long, attention=a)) for a in ("eager", "chunked"))
    assert eager == long.live_sequences * SHAPE.heads * 1024 * 1024 * 4
    assert chunked < eager / 3  # one block of 128 keys at a time (scores and probabilities) + an fp32 output


def test_a_tpu_plan_carries_no_cpu_compiler_effect():
    """On one CPU device XLA:CPU keeps every layer's attention despite checkpointing; a TPU plan must not."""
    every_layer = ["sharding.activation_checkpointing=true", "train.gradient_accumulation_steps=1"]
    recipe = load_recipe(ROOT / "recipes/open_llama_lora_v5e1.yaml", every_layer)
    report = memory_report.plan_recipe(recipe, default_device(recipe), require_config(recipe))
    st, s = report.plan.setting, shape.shape_of(require_config(recipe))
    assert report.device.name == "v5e-1" and st.devices == 1 and st.sequences == 4
    kept = tpu_layout.kept(s, st, True)
    assert kept == int(26 * 3.9 * st.tokens * s.hidden * 2)  # 3.9 hidden-sized tensors per layer on one chip
    assert report.plan.activations == kept
    assert cpu_layout.activations(s, st, "cpu") > 5 * kept  # the CPU layout keeps it: 26 layers' attention
    # The TPU compiler: 10.15 of 15.75 GiB (docs/tpu_compile.json); the plan keeps its margin on top.
    assert report.plan.fits and report.plan.capacity - report.plan.needed > 3 * GiB


def test_every_shipped_open_llama_recipe_fits_its_target():
    for name in (
        "open_llama_lora",
        "open_llama_lora_v5e1",
        "open_llama_full",
        "open_llama_7b_qlora",
        "llama2_70b_qlora_v5e8",
    ):
        recipe = load_recipe(ROOT / f"recipes/{name}.yaml")
        assert recipe.runtime.target in ("v5e-8", "v5e-1"), name
        report = memory_report.plan_recipe(recipe, default_device(recipe), require_config(recipe))
        assert report.plan.fits, name


def test_the_device_catalog():
    from lowmem_tpu.config.devices import DEVICES, device_for, generation_of

    assert {"v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v4-8", "v5p-8", "v3-8", "v2-8"} <= set(DEVICES)
    assert all(d.peak_flops and 0 < d.hbm_bytes <= 95 * GiB for d in DEVICES.values())
    assert DEVICES["v3-8"].legacy and DEVICES["v2-8"].legacy and not DEVICES["v5e-8"].legacy
    assert generation_of("TPU v5 lite").name == "v5e" and generation_of("TPU v6e").name == "v6e"
    assert generation_of("TPU v5").name == "v5p" and generation_of("cpu") is None
    assert device_for("v5e", 8).name == "v5e-8" and device_for("v4", 4).name == "v4-8"
    assert device_for("v3", 8).name == "v3-8" and device_for("v5e", 2) is None


def test_unknown_model_type_and_bad_batch_are_user_errors():
    with pytest.raises(UserError, match="Llama-like"):
        shape.shape_of(SimpleNamespace(model_type="t5", d_model=512))
    recipe = load_recipe(ROOT / "recipes/tiny_lora_cpu.yaml", ["train.global_batch_size=4"])  # 4 CPU devices
    with pytest.raises(UserError, match="must split evenly over 8 devices"):
        memory_report.plan_recipe(recipe, "v3-8", require_config(recipe))


# ----------------------------------------------------------------------------- the command line


def test_memory_command_prints_both_modes_without_heavy_imports():
    done = cli("memory", "recipes/open_llama_lora.yaml", importtime=True)  # its runtime.target: v5e-8
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LoRA, 25,425,920 trainable" in done.stdout and "full fine-tuning, 3,426,473,600 trainable" in done.stdout
    assert "on v5e-8 (TPU v5e-8: 8 chips x 16 GiB (Kaggle's free TPU))" in done.stdout
    assert "of 15.8 GiB: fits" in done.stdout
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "import time:" in line}
    assert not loaded & set(HEAVY)


def test_memory_json_and_the_suggestion_chain():
    done = cli(
        "memory",
        "recipes/open_llama_full.yaml",
        "train.optimizer=adamw",
        "sharding.activation_checkpointing=false",
        "train.gradient_accumulation_steps=1",
        "--target",
        "v2-8",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["device"]["name"] == "v2-8" and data["recipe"]["mode"] == "full" and data["twin"]["mode"] == "lora"
    assert not data["recipe"]["fits"]
    steps = data["recipe"]["next_steps"]
    assert steps[0]["override"] == "train.gradient_accumulation_steps=2"  # the cheapest lever first
    assert "sharding.activation_checkpointing=true" in [step["override"] for step in steps]
    assert steps[-1]["plan"]["fits"]
    assert data["recipe"]["bytes"]["weights"] == 856_630_272  # 3.43 B bf16 parameters / 8 chips, in (8, 128) tiles


def test_unknown_device_lists_the_known_ones():
    done = cli("memory", "recipes/tiny_lora_cpu.yaml", "--target", "v9-8")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown device 'v9-8'" in done.stderr and "v5e-1" in done.stderr and "cpu" in done.stderr


def test_the_qlora_recipe_plans_for_one_chip_without_a_device_flag():
    done = cli("memory", "recipes/open_llama_7b_qlora.yaml")  # a batch of 4 that 8 devices could not split
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on v5e-1" in done.stdout and "micro-batch 4 x 1024 tokens per device, 1 accumulation" in done.stdout


def test_validate_checks_the_batch_split_for_the_target():
    done = cli("validate", "recipes/open_llama_7b_qlora.yaml", "runtime.target=v5e-8")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "must split evenly over 8 devices" in done.stderr and "runtime.target: v5e-8" in done.stderr
    done = cli("validate", "recipes/open_llama_lora.yaml", "runtime.target=v7")
    assert done.returncode == 2 and "runtime.target" in done.stderr and "v5e-1" in done.stderr


def test_model_without_an_offline_config_says_how_to_supply_it():
    done = cli("memory", "recipes/open_llama_lora.yaml", "model.name_or_path=acme/no-such-model")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not available offline" in done.stderr and "config.json" in done.stderr
    assert "acme__no-such-model.json" in done.stderr


# ----------------------------------------------------------------------------- reading the compiler


def test_buffer_assignment_and_shard_sizes_are_parsed(tmp_path):
    text = (
        "allocation 0: size 400, parameter 0, shape |f32[10,10]| at ShapeIndex {}:\n"
        "allocation 1: size 1000, preallocated-temp:\n"
        "allocation 2: size 64, maybe-live-out:\n"
        "Total bytes used: 1464 (1.4KiB)\n"
        "  Live ranges at 7 (peak):\n"
        "    dot.3{}: 1000 bytes (cumulative: 1000 bytes)\n"
        "    param.0{}: 234 bytes (cumulative: 1234 bytes)\n"
        "  Stack trace breakdown for peak usage: 1 234 bytes\n"
    )
    path = tmp_path / "module_0001.SyncTensorsGraph.9.cpu_after_optimizations-buffer-assignment.txt"
    path.write_text(text)
    hlo = "ENTRY %main {\n  %dot.3 = f32[25,10]{1,0} dot(%a, %b)\n}\n"
    (tmp_path / "module_0001.SyncTensorsGraph.9.cpu_after_optimizations.txt").write_text(hlo)
    assert live_at_peak(path) == [("dot.3", "f32[25,10]", 1000), ("param.0", "?", 234)]
    f = parse_buffer_assignment(path)
    assert (f.total_bytes, f.parameter_bytes, f.temp_bytes, f.output_bytes, f.peak_live_bytes) == (
        1464,
        400,
        1000,
        64,
        1234,
    )
    assert f.module == "module_0001.SyncTensorsGraph.9"
    assert numel_per_device((10, 7), "{devices=[4,1]0,1,2,3}") == 3 * 7
    assert numel_per_device((10, 7), "{replicated}") == 70 and numel_per_device((10, 7), "") == 70
    assert numel_per_device((8, 6), "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}") == 4 * 6


# ----------------------------------------------------------------------------- a quantized base (QLoRA)


def test_quantized_base_holds_integers_and_scales_and_counts_logical_parameters():
    h, i, n, r = 64, 160, 3, 8
    lora = replace(BASE, lora=True, dtype="bfloat16")
    int8 = plan(replace(lora, quantize="int8"), layout="cpu")
    int4 = plan(replace(lora, quantize="int4", group_size=32), layout="cpu")
    # int8: [out, in] at 1 byte + one bf16 scale per row; int4: [ceil(in/32)*16, out] bytes + [out, ceil(in/32)].
    tensors = memory.parameters(SHAPE, replace(lora, quantize="int4", group_size=32))
    gate = [t for t in tensors if t.shape == (32, i) and t.itemsize == 1]  # gate/up: [160, 64] -> [32, 160] packed
    assert len(gate) == 2 * n and all(t.parameters == i * h for t in gate)
    down = [t for t in tensors if t.shape == (80, h) and t.itemsize == 1]  # down: in 160 -> 5 groups -> 80 bytes
    assert len(down) == n
    assert plan(lora).total_parameters == int8.total_parameters == int4.total_parameters  # logical, not packed
    per_layer8 = 4 * (16 * h + 16 * 2) + 2 * (40 * h + 40 * 2) + (16 * i + 16 * 2)  # sharded rows, 4 devices
    adapters = n * (4 * r * (h + h) + 3 * r * (h + i)) * 4 // 4  # fp32 adapters, split over 4 devices
    assert int8.weights == (2 * 25 * h + 16) * 2 + n * (per_layer8 + 2 * 16 * 2) + adapters
    assert int4.weights < int8.weights < plan(lora, layout="cpu").weights
    assert int8.gradients == plan(lora, layout="cpu").gradients and int8.optimizer == plan(lora, layout="cpu").optimizer


def test_dequantized_transient_is_one_projection():
    st = replace(BASE, lora=True, quantize="int8")
    largest = 160 * 64 * 4  # gate/up/down, fp32
    assert plan(st, layout="cpu").dequantized == largest
    assert plan(replace(st, quantize="none")).dequantized == 0
    assert plan(replace(BASE, quantize="int8")).dequantized == 0  # not LoRA: the recipe refuses it; no base quantized
    one = replace(st, devices=1, global_batch=2)
    assert plan(one, layout="cpu").dequantized == largest
    # TPU, FSDP over 4 chips, 256 tokens in all against a width of 64: the weights gathered, 5.3 more
    # hidden-sized tensors per token in each of the 3 layers (the TPU compiler, Open Llama 3B int4), and
    # each chip's whole dequantized projection after the packed gather (1.6 fp32 copies of the largest)
    gathered = 1.6 * 160 * 64 * 4
    assert plan(st).dequantized == int(3 * 5.3 * 2 * 32 * 64 * 4 + gathered)
    # 4 x 8 tokens in all, under the width: the activations are gathered instead (Llama 2 70B int4)
    few = replace(st, length=8, global_batch=4)
    assert plan(few).dequantized == int(3 * 1.8 * 8 * 64 * 4 + gathered)
    assert plan(one).dequantized == 0  # one chip: no more than a bf16 base keeps (Open Llama 3B and 7B int4)
    p = plan(st, layout="cpu")
    backward = max(p.logits + p.workspace, cpu_layout.backward_workspace(SHAPE, st))
    assert p.peak == p.weights + p.optimizer + p.activations + backward + p.dequantized + p.gradients


def test_quantized_lm_head_is_counted_and_dequantized_whole():
    st = replace(BASE, lora=True, quantize="int8", quantize_lm_head=True, devices=1, global_batch=2)
    p, kept = plan(st, layout="cpu"), plan(replace(st, quantize_lm_head=False), layout="cpu")
    assert p.weights == kept.weights - 100 * 64 * 4 + 100 * 64 + 100 * 4  # head: int8 [100, 64] + fp32 scales
    assert p.workspace == 100 * 64 * 4 and kept.workspace == 0  # one device: only a quantized head is rebuilt
    assert plan(st).workspace == 100 * 64 * 4 and plan(replace(st, quantize_lm_head=False)).workspace == 0  # TPU


def test_quantization_is_suggested_to_lora_only_and_shown_in_the_report():
    seven = ["model.name_or_path=openlm-research/open_llama_7b_v2", "train.global_batch_size=1"]
    seven += ["model.attn_implementation=chunked", "train.chunked_loss=true", "data.max_length=2048"]  # levers on
    seven += ["train.gradient_accumulation_steps=1", "sharding.activation_checkpointing=true"]
    recipe = load_recipe(ROOT / "recipes/open_llama_lora.yaml", [*seven, "runtime.num_cpu_devices=1"])
    report = memory_report.plan_recipe(recipe, "v5e-1", require_config(recipe))
    assert not report.plan.fits
    overrides = [s.override for s in report.steps]
    assert overrides == ["model.quantize=int8"] and report.steps[-1].plan.fits
    twin = [s.override for s in report.twin_steps]  # full fine-tuning: a quantized base only after LoRA
    assert all(twin.index("lora.enabled=true") < i for i, o in enumerate(twin) if o.startswith("model.quantize"))
    int4 = load_recipe(
        ROOT / "recipes/open_llama_lora.yaml", [*seven, "runtime.num_cpu_devices=1", "model.quantize=int4"]
    )
    quantized = memory_report.plan_recipe(int4, "v5e-1", require_config(int4))
    assert quantized.plan.fits and quantized.twin.setting.quantize == "none" and not quantized.twin.setting.lora
    assert 6.7e9 < quantized.plan.total_parameters < 6.8e9
    text = memory_report.format_report(quantized)
    assert "LoRA on an int4 base" in text
    # One chip: the TPU compiler keeps no more per layer for an int4 base than for bf16 (docs/tpu_compiler.md),
    # only the fp32 dequantization of a projection at a time: 4.5 fp32 copies of the 7B's largest one.
    assert "a quantized base's extra activations (every layer)" not in text
    assert "the int4 base's fp32 dequantization (one chip)" in text
    assert quantized.plan.dequantized == int(tpu_layout.INT4_ONE_CHIP_FP32_COPIES * 11008 * 4096 * 4)
    assert "lora.enabled=false model.quantize=none" in text
    assert memory_report.report_json(quantized)["recipe"]["setting"]["quantize"] == "int4"


def test_the_tpu_plan_is_within_ten_percent_at_open_llama_3b_width_over_the_grid_of_levers(tmp_path):
    """The TPU compiler's figures over a grid of levers (benchmarks/results/tpu_planner_grid.json): at Open Llama
    3B's width (``w3b``, 4 of its layers at the shipped recipes' batch) on v5e-8 and v5e-1, the planner as it is
    now (the benchmark's ``--replan``, which compiles nothing) is within 10% of every point: LoRA and full, every
    layer, one in two or none recomputed, accumulation, chunked loss and attention, int4."""
    import subprocess
    import sys

    grid = tmp_path / "grid.json"
    grid.write_text((ROOT / "benchmarks/results/tpu_planner_grid.json").read_text())
    command = [sys.executable, str(ROOT / "benchmarks/tpu_planner_grid.py"), "--json", str(grid), "--replan"]
    subprocess.run(command, capture_output=True, text=True, check=True)
    wide = [r for r in json.loads(grid.read_text()) if r["model"] == "w3b"]
    assert {r["device"] for r in wide} == {"v5e-8", "v5e-1"} and len(wide) >= 14
    assert {"lora, checkpointing", "full, checkpointing"} <= {r["point"] for r in wide}
    assert [(r["device"], r["point"], r["error"]) for r in wide if abs(r["error"]) > 0.10] == []


def _shipped_plans():
    """(recipe@target, the TPU compiler's record, the plan) for every shipped recipe compiled in
    docs/tpu_compile.json but the tiny demos (their few MiB are the compiler's fixed costs and on-chip memory)."""
    for key, record in json.loads((ROOT / "docs/tpu_compile.json").read_text()).items():
        name, device = key.split("@")
        if name.startswith("tiny") or not record.get("needed"):
            continue
        recipe = load_recipe(ROOT / f"recipes/{name}.yaml", ["runtime.device=tpu"])
        yield key, record, memory_report.plan_recipe(recipe, device, require_config(recipe))


def test_the_tpu_plan_is_within_ten_percent_of_the_tpu_compiler_on_the_shipped_recipes():
    """docs/tpu_compile.json holds the TPU compiler's figure for every shipped recipe it could compile here
    (``make tpu-compile-check`` keeps it current); the planner's TPU layout must stay within 10% of each at
    real size that it is read off (every layer recomputed, one micro-batch over several chips; LoRA with flash
    and no layer recomputed); a tuned recipe unlike those is within 10% or under the compiler's figure by no
    more than the plan's note says.
    The tiny demo is left out: its few MiB are the compiler's fixed costs and on-chip memory. The QLoRA,
    family and DPO recipes are compiled at 2 and 4 layers and extrapolated. Phi's steps
    (fused projections) are over-planned, not yet calibrated: within 25%, above the compiler; so are the QLoRA
    recipes' several rows in one program (within 30%, above)."""
    checked, extrapolated, uncalibrated = [], [], []
    for key, record, report in _shipped_plans():
        error = (report.plan.peak - record["needed"]) / record["needed"]
        if not tpu_layout.calibrated(report.plan.setting):  # tuned: fewer layers recomputed, said in the plan
            uncalibrated.append((key, record["needed"] / report.plan.peak - 1))
            assert "read off steps that recompute every layer" in memory_report.format_report(report)
            continue
        (extrapolated if record.get("extrapolated_from") else checked).append((key, error))
    # the QLoRA recipes (every layer recomputed) and the tuned LoRA recipes with flash and nothing recomputed
    assert len(extrapolated) + len(checked) >= 12, (extrapolated, checked)
    for key, error in checked + extrapolated:
        low, high = (0.0, 0.25) if key.startswith("phi") else (-0.10, 0.10)  # the error allowed
        if "qlora" in key:  # several rows of an NF4 base in one program: over-planned, not yet calibrated
            low, high = 0.0, 0.30
        assert low <= error <= high, (key, error)
    # Full fine-tuning with no layer recomputed is over-planned by up to 25%: the plan holds every layer's
    # activations beside every layer's gradient copies, the compiler frees the first as the second grow
    # (open_llama_full at 2 and 4 layers: 133 MiB a layer; planned, 120 of activations and 74 of gradient copies).
    # Phi's fused projections are over-planned as above, whatever it recomputes.
    more = [
        (key, m)
        for key, m in uncalibrated
        if not (-0.20 if key.startswith(("open_llama_full", "phi")) else -0.10) <= m <= tpu_layout.UNCALIBRATED_MORE
    ]
    assert uncalibrated and more == [], uncalibrated  # under by no more than the note says (or within 10%)


def test_no_shipped_recipe_the_tpu_compiler_fits_is_planned_as_not_fitting():
    """A tuned recipe fills the chip by the compiler's figure; the plan adds its margin, so near the top it says
    "on the edge" (the peak within the planner's band of the chip) and names --compile, never "does not fit"."""
    edges = []
    for key, record, report in _shipped_plans():
        if not record.get("fits"):
            continue
        assert report.plan.fits or memory_report.on_the_edge(report.plan), key
        if not report.plan.fits:
            edges.append(key)
            text = memory_report.format_report(report)
            assert "on the edge" in text and "--compile gives the TPU compiler's verdict" in text
            assert "does not fit" not in text.split("its twin")[0]
    assert "llama3_3b_dpo_v5e1@v5e-1" in edges  # 14.71 of 15.75 GiB by the compiler: planned over with its margin
    far = load_recipe(
        ROOT / "recipes/mistral_7b_lora_v5e8.yaml",
        ["runtime.device=tpu", "train.global_batch_size=32", "train.gradient_accumulation_steps=1"],
    )
    plan = memory_report.plan_recipe(far, "v5e-8", require_config(far)).plan
    assert not plan.fits and not memory_report.on_the_edge(plan)  # 4 rows per chip: plainly over
