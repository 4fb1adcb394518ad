"""``lowmem-tpu memory --compile``: the real TPU compiler (libtpu's compile-only client) on this CPU machine.

The tiny recipe's steady step is traced with placeholders and compiled for Kaggle's v5e-8 (v5e:2x4)
and Colab's v5e-1 (v5e:1x1). The traps that would give wrong figures silently are pinned: donors
dropped (aliasing 0), outputs gathered, placeholders left replicated; and the placeholder program
must cost what the same step with real weights costs (what needs no compile: unit/test_tpu_compile_rules.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from cli_runs import compiler_cli as cli
from markers import needs_compiler

from lowmem_tpu.errors import UserError
from lowmem_tpu.measure import tpu_compile

TINY = "recipes/tiny_lora_cpu.yaml"
pytestmark = needs_compiler


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """The tiny recipe compiled for 8 chips and for 1, as ``--json`` reports it."""
    out = {}
    for device in ("v5e-8", "v5e-1"):
        done = cli("memory", TINY, "--compile", "--target", device, "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        out[device] = json.loads(done.stdout)
    return out


def test_the_tiny_step_compiles_for_kaggle_and_colab_and_fits(compiled):
    for device, chips in (("v5e-8", 8), ("v5e-1", 1)):
        r = compiled[device]
        assert r["chips"] == chips and r["kind"] == "TPU v5 lite" and r["libtpu"] == "0.0.21"
        assert r["fits"] and 0 < r["needed"] < r["capacity"] == int(15.75 * 2**30)
        assert r["needed"] == r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"]
        assert r["temporaries"] > 0 and r["scratch"] > 0  # HBM and on-chip memory are told apart
        assert r["planned_peak"] > 0 and r["plan_error"] is not None
        estimate = r["step_estimate"]
        assert estimate["reported"] and estimate["step_seconds"] > 0 and 0 < estimate["mfu"] < 1
        # The sums with every loop body once are the flops XLA's own cost analysis reports (which adds
        # the elementwise ops: a few percent on this tiny model), and the trip counts add to them.
        assert 0.8 * r["cost"]["flops"] < r["step"]["flops_once"] <= r["cost"]["flops"]
        assert r["step"]["flops"] >= r["step"]["flops_once"] and r["step"]["loops_unresolved"] == 0


def test_donors_survive_and_outputs_stay_sharded(compiled):
    eight, one = compiled["v5e-8"], compiled["v5e-1"]
    for r in (eight, one):
        # Every trained tensor (adapters, their AdamW state) is donated and its output reuses the buffer.
        assert r["donated"] > 0 and r["aliased"] > 0
        assert r["outputs"] - r["aliased"] < 0.05 * r["outputs"]
    # Sharded over 8 chips, each holds a fraction of what one chip holds (an eighth but for the (8, 128) tiles
    # that pad the tiny model's small shards: 2.5 times less here); gathered outputs would be the full size.
    assert eight["arguments"] < one["arguments"] / 2
    assert eight["outputs"] < one["outputs"] / 2


def test_placeholders_cost_what_real_weights_cost(tmp_path):
    """The placeholder trace against the same steady step traced with real weights (after one real step)."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.config.devices import DEVICES
    from lowmem_tpu.measure.buffers import hbm_allocations
    from lowmem_tpu.measure.local import spawn_step

    recipe = load_recipe(TINY, ["train.global_batch_size=16"])
    placeholder = tpu_compile.compile_recipe(recipe, DEVICES["v5e-4"], keep=tmp_path / "placeholders")
    # The real step 2: weights materialized, optimizer state made by step 1 (which really ran).
    dump = tmp_path / "real" / "trace"
    dump.mkdir(parents=True)
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_FLAGS": tpu_compile.TRACE_FLAGS.format(dir=dump)}
    overrides = ["runtime.device=cpu", "runtime.num_cpu_devices=4", "runtime.compile_cache_dir=null"]
    record = spawn_step("compile", recipe, overrides, 2, env | {"LOWMEM_DUMP_DIR": str(dump)}, 600)
    step = max(record["programs"], key=lambda name: (dump / name).stat().st_size)
    module = next(dump.glob(step.split(".cpu_after")[0] + ".before_optimizations.hlo.pb"))
    request = {
        "module": str(module),
        "module_text": str(module).removesuffix(".hlo.pb") + ".txt",
        "topology": "v5e:2x2",
        "host_bounds": [2, 2, 1],
        "devices": 4,
        "placeholders": 0,
        "strategy": "fsdp",
    }
    tpu = tmp_path / "real" / "tpu"
    tpu.mkdir()
    real = tpu_compile._compile(request, tmp_path / "real", tpu, 600)
    hbm = hbm_allocations(tpu_compile.buffer_assignment(tpu))
    stats = real["stats"]
    # The real step 2 carries a few more scalars (each a padded 512-byte buffer on a TPU): 2.5 KB of 2 MB here.
    scalars = 16 * 512
    assert abs(placeholder.arguments - stats["argument_size_in_bytes"]) <= scalars
    assert abs(placeholder.aliased - stats["alias_size_in_bytes"]) <= scalars
    assert abs(placeholder.outputs - stats["output_size_in_bytes"]) <= scalars
    assert placeholder.temporaries == pytest.approx(hbm.temporaries, rel=0.05)


def test_accumulation_compiles_the_micro_batch_with_the_optimizer_state_beside_it(compiled):
    """With 2 micro-batches the traced program is the first one's forward and backward: it takes the
    weights only, and the AdamW state it leaves in HBM is added by the shard rule and the TPU's tiles."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.memory.plan import parameters
    from lowmem_tpu.memory.shape import setting_of, shape_of
    from lowmem_tpu.memory.tiles import tpu_shard_bytes
    from lowmem_tpu.model.build import require_config

    done = cli("memory", TINY, "train.gradient_accumulation_steps=2", "--compile", "--target", "v5e-8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    r, whole = json.loads(done.stdout), compiled["v5e-8"]
    recipe = load_recipe(TINY)
    adapters = [t for t in parameters(shape_of(require_config(recipe)), setting_of(recipe, 8)) if t.trainable]
    assert r["resident"] == 2 * sum(tpu_shard_bytes(t.shape, 4, "fsdp", 8) for t in adapters)  # exp_avg, exp_avg_sq
    assert r["needed"] == r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"] + r["resident"]
    assert r["placeholders"] < whole["placeholders"] and r["fits"]
    assert r["temporaries"] < whole["temporaries"]  # half the sequences in the program


def test_full_fine_tuning_hands_its_gradients_sharded_between_micro_batches(tmp_path):
    """Trap ``whole-gradients``: a micro-batch's program outputs the accumulated gradients for the next one. Left
    to itself SPMD outputs them whole on every chip (2.9 MB of outputs here against 1.0); each is sharded like its
    weight. The tiny model's weights: [128, 128], [256, 128], [128, 256] (out, in), the embedding [48, 128]."""
    import re

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.config.devices import DEVICES
    from lowmem_tpu.measure.buffers import optimized_hlo

    recipe = load_recipe(TINY, ["lora.enabled=false", "train.gradient_accumulation_steps=2", "runtime.device=auto"])
    result = tpu_compile.compile_recipe(recipe, DEVICES["v5e-8"], keep=tmp_path)
    entry = optimized_hlo(tpu_compile.buffer_assignment(tmp_path / "tpu")).read_text().split("ENTRY", 1)[1]
    outputs = re.findall(r"f32\[([\d,]*)\]", entry.split("\n", 1)[0].split(") -> (", 1)[1])
    whole = {"128,128", "256,128", "128,256", "48,128", "128,48"}
    assert result.fits and outputs and not whole & set(outputs)
    assert {"16,128", "32,128", "128,32"} <= set(outputs)  # an eighth of each, split along its largest dimension


def test_scan_layers_without_its_extra_is_one_line_before_anything_runs(monkeypatch, tmp_path):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    from lowmem_tpu.xla import extras

    with monkeypatch.context() as patch:
        patch.setattr(extras.importlib.metadata, "version", absent)
        with pytest.raises(UserError, match=r"not installed as a package.*make install-scan"):
            extras.require_scan_extra(load=False)
    try:
        importlib.metadata.version("torchax")
        pytest.skip("the [scan] extra is installed here: scan_layers traces")
    except importlib.metadata.PackageNotFoundError:
        pass
    for flags in (["--compile", "--target", "v5e-8"], ["--compile", "--target", "cpu"]):  # cpu: the child's error, said
        done = cli("memory", TINY, "sharding.scan_layers=true", *flags)
        assert done.returncode == 2 and "make install-scan" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    kept = tmp_path / "out" / "final" / "adapter_config.json"  # an earlier run's, which --overwrite would clear
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    sft = cli("sft", TINY, "sharding.scan_layers=true", f"output_dir={tmp_path / 'out'}", "--overwrite")
    assert sft.returncode == 2 and "make install-scan" in sft.stderr and "Traceback" not in sft.stderr
    assert kept.exists() and not (tmp_path / "out" / "base").exists()
    valid = cli("validate", TINY, "sharding.scan_layers=true")
    assert valid.returncode == 2 and "make install-scan" in valid.stderr


def test_full_fine_tuning_in_bf16_traces_with_its_fp32_master_weights():
    """Every base weight trained, its fp32 master a placeholder too. Tracing it found accelerate copying the
    optimizer's state dict through the host at prepare time (each master rebuilt replicated on every chip):
    the masters are kept out of that dict, and this trace fails if they come back into it."""
    done = cli("memory", TINY, "lora.enabled=false", "model.dtype=bfloat16", "--compile", "--target", "v5e-4", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    # 39 parameters (4 layers of 7 projections and 2 norms, embedding, norm, head), each a placeholder with its
    # fp32 master and AdamW's two moments; about 0.67 M weights, 2 + 4 + 8 bytes each, a quarter per chip.
    assert r["fits"] and r["placeholders"] == 4 * 39 and r["arguments"] > 0.67e6 * (2 + 4 + 8) / 4
    assert r["aliased"] > 0.9 * r["outputs"]


WATCHED = """
import sys, threading, torch, torch_xla
from pathlib import Path
from lowmem_tpu.measure.trace import ProgramWatcher
from lowmem_tpu.xla.sharding import placeholder

x = placeholder((256, 256), torch.float32)
for _ in range(8):
    x = torch.tanh(x @ x)
taken = threading.Event()
ProgramWatcher(Path(sys.argv[1]), lambda module, text: taken.set()).start()
try:
    torch_xla.sync()
except RuntimeError as err:
    print("refused" if "Unexpected execution" in str(err) else err, taken.wait(30))
"""


def test_a_traced_program_on_placeholders_is_taken_and_never_runs(tmp_path):
    """The watcher refuses the execution as the CPU compiler starts: a program on placeholders that ran
    would crash the trace (a SIGSEGV in torch_xla's ExecuteReplicated), as a small one did, now and then,
    when it compiled faster than its dump settled."""
    flags = tpu_compile.TRACE_FLAGS.format(dir=tmp_path)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PJRT_LOCAL_PROCESS_RANK": "0", "XLA_FLAGS": flags}
    done = subprocess.run(
        [sys.executable, "-c", WATCHED, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused", "True"]


@pytest.mark.parametrize("method", ["int4", "nf4"])  # int8 takes int4's path (QuantizedLinear.dequantized_when)
def test_a_quantized_base_gathers_packed_bytes_or_nf4_its_dequantized_shards(tmp_path, method):
    """int4: the all-gathers of the TPU compiler's program move the packed u8 weights and their scales, never a
    dequantized decoder weight. NF4: each chip dequantizes its own shard of the indices, so the all-gathers
    move the block maxima and the bf16 weights, never the packed indices. The tiny model's projections are
    [128, 128], [256, 128], [128, 256] (out, in)."""
    import re

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.config.devices import DEVICES
    from lowmem_tpu.measure.buffers import optimized_hlo

    overrides = [f"model.quantize={method}", "model.quantize_group_size=32", "runtime.device=auto"]
    result = tpu_compile.compile_recipe(load_recipe(TINY, overrides), DEVICES["v5e-8"], keep=tmp_path)
    program = optimized_hlo(tpu_compile.buffer_assignment(tmp_path / "tpu")).read_text()
    gathered = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", program)
    weights = {"128,128", "256,128", "128,256"}
    floats = {d for t, d in gathered if t in ("bf16", "f32") and d in weights}
    bytes_ = {d for t, d in gathered if t == "u8"}
    assert gathered and result.fits and result.gathered["u8"] > 0
    if method == "int4":
        assert not floats and bytes_ >= {"64,128", "64,256", "128,128"}  # [in / 2, out]: two weights a byte
    else:  # the maxima, one byte per 32 weights; never the indices (64 x 128 bytes at the least)
        assert floats and max(math.prod(int(n) for n in d.split(",")) for d in bytes_) <= 32 * 32
