"""``lowmem-tpu memory --compile``: the real TPU compiler (libtpu's compile-only client) on this CPU machine.

The tiny recipe's steady step is traced with placeholders and compiled for Kaggle's v5e-8 (v5e:2x4)
and Colab's v5e-1 (v5e:1x1). The traps that would give wrong figures silently are pinned: donors
dropped (aliasing 0), outputs gathered, placeholders left replicated; and the placeholder program
must cost what the same step with real weights costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lowmem_tpu.errors import UserError
from lowmem_tpu.memory import tpu_compile
from lowmem_tpu.memory.compiler import out_of_memory
from lowmem_tpu.memory.tpu_compile import TpuCompile, compile_target
from lowmem_tpu.memory.tpu_report import cost_bounds, format_compile
from lowmem_tpu.xla.tpu_compiler import buffer_donors, fsdp_sharding

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny_lora_cpu.yaml"
pytestmark = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("jax", "libtpu")),
    reason="the [compiler] extra is not installed",
)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """The tiny recipe compiled for 8 chips and for 1, as ``--json`` reports it."""
    out = {}
    for device in ("v5e-8", "v5e-1"):
        done = cli("memory", TINY, "--compile", "--device", device, "--json")
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
        assert r["cost_bounds"]["reported"] and r["cost_bounds"]["step_seconds_at_least"] > 0


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
    from lowmem_tpu.memory.compiler import hbm_allocations
    from lowmem_tpu.memory.measure import spawn_step

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
    from lowmem_tpu.memory.shape import require_config, setting_of, shape_of
    from lowmem_tpu.memory.tiles import tpu_shard_bytes

    done = cli("memory", TINY, "train.gradient_accumulation_steps=2", "--compile", "--device", "v5e-8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    r, whole = json.loads(done.stdout), compiled["v5e-8"]
    recipe = load_recipe(TINY)
    adapters = [t for t in parameters(shape_of(require_config(recipe)), setting_of(recipe, 8)) if t.trainable]
    assert r["resident"] == 2 * sum(tpu_shard_bytes(t.shape, 4, "fsdp", 8) for t in adapters)  # exp_avg, exp_avg_sq
    assert r["needed"] == r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"] + r["resident"]
    assert r["placeholders"] < whole["placeholders"] and r["fits"]
    assert r["temporaries"] < whole["temporaries"]  # half the sequences in the program


def test_the_fit_arithmetic_and_a_refusal_read_as_does_not_fit():
    base = TpuCompile("v5e-1", "v5e:1x1", 1, 100, "0.0.21", "TPU v5 lite", 1.0, 2.0, 0, 3, 2)
    ok = replace(base, arguments=40, outputs=30, aliased=25, temporaries=50)
    assert ok.needed == 95 and ok.fits
    assert not replace(ok, temporaries=56).fits  # 101 > 100: outputs count, though the compiler's refusal does not
    message = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 20.00G of 15.75G hbm. Exceeded hbm capacity by 4.25G."
    )
    refused = replace(base, capacity=int(15.75 * 2**30), refused=out_of_memory(message))
    assert not refused.fits and refused.needed == 20 * 2**30
    text = format_compile(refused, 10 * 2**30, {}, "chunked loss [train.chunked_loss=true]")
    assert "does not fit: the TPU compiler asks for 20.00 GiB of 15.75 GiB hbm" in text
    assert "next: chunked loss [train.chunked_loss=true]" in text


def test_module_header_and_placeholder_sharding_rules():
    header = "HloModule SyncTensorsGraph.1, buffer_donor={ (0, {}), (3, {}), (12, {}) }, entry_computation_layout={}"
    assert buffer_donors(header) == [0, 3, 12]
    assert buffer_donors("HloModule SyncTensorsGraph.1, entry_computation_layout={}") == []
    assert fsdp_sharding([3200, 8640], 8, "fsdp") == "{devices=[1,8]0,1,2,3,4,5,6,7}"
    assert fsdp_sharding([32000, 3200], 4, "fsdp") == "{devices=[4,1]0,1,2,3}"
    assert fsdp_sharding([16, 16], 4, "fsdp") == "{devices=[4,1]0,1,2,3}"  # the first largest, as FSDPv2
    assert fsdp_sharding([3200], 1, "fsdp") == fsdp_sharding([3200], 8, "replicated") == "{replicated}"


def test_bad_input_exits_2_with_the_fix(monkeypatch):
    unknown = cli("memory", TINY, "--compile", "--device", "v9-8")
    assert unknown.returncode == 2 and "unknown device 'v9-8'" in unknown.stderr and "v5e-8" in unknown.stderr
    no_target = cli("memory", TINY, "--compile")
    assert no_target.returncode == 2 and "name one with --device" in no_target.stderr
    legacy = cli("memory", TINY, "--compile", "--device", "v3-8")
    assert legacy.returncode == 2 and "no v3-8" in legacy.stderr
    split = cli("memory", TINY, "train.global_batch_size=12", "--compile", "--device", "v5e-8")
    assert split.returncode == 2 and "12" in split.stderr and "Traceback" not in split.stderr
    assert "tracing" not in split.stderr  # refused before the trace is announced
    both = cli("memory", TINY, "--measure", "--compile", "--device", "v5e-8")
    assert both.returncode == 2 and "one at a time" in both.stderr
    flash = cli("memory", TINY, "model.attn_implementation=flash", "--compile", "--device", "v5e-8")  # 24 tokens
    assert flash.returncode == 2 and "24 cannot be tiled" in flash.stderr and "Traceback" not in flash.stderr
    with pytest.raises(UserError, match=r"unknown device 'nope'"):
        compile_target("nope")
    monkeypatch.setattr(tpu_compile.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"\.\[compiler\]"):
        tpu_compile.require_compiler()


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
    for flags in (["--compile", "--device", "v5e-8"], ["--measure"]):  # --measure: the child's error, said
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
    done = cli("memory", TINY, "lora.enabled=false", "model.dtype=bfloat16", "--compile", "--device", "v5e-4", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    # 39 parameters (4 layers of 7 projections and 2 norms, embedding, norm, head), each a placeholder with its
    # fp32 master and AdamW's two moments; about 0.67 M weights, 2 + 4 + 8 bytes each, a quarter per chip.
    assert r["fits"] and r["placeholders"] == 4 * 39 and r["arguments"] > 0.67e6 * (2 + 4 + 8) / 4
    assert r["aliased"] > 0.9 * r["outputs"]


def test_a_step_too_big_to_compile_here_is_the_line_through_2_and_4_layers(tmp_path):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.memory.tpu_layers import cut, extrapolate, layers_of

    recipe = load_recipe("recipes/open_llama_7b_qlora.yaml", ["runtime.device=tpu"])
    two = cut(recipe, 2, tmp_path)
    assert layers_of(recipe) == 32 and layers_of(two) == 2 and two.model.quantize == "int4"
    assert json.loads((tmp_path / "layers-2" / "config.json").read_text())["hidden_size"] == 4096

    base = TpuCompile("v5e-1", "v5e:1x1", 1, 1000, "0.0.21", "TPU v5 lite", 1.0, 2.0, 50, 30, 28)
    a = replace(base, arguments=20, outputs=10, aliased=8, temporaries=30, cost={"flops": 2.0})
    b = replace(base, arguments=36, outputs=18, aliased=14, temporaries=40, cost={"flops": 4.0}, host_peak_rss_bytes=90)
    whole = extrapolate({4: b, 2: a}, 32)  # per layer: 8 + 4 - 3 + 5 = 14 needed, from 52 at 2 layers
    assert whole.needed == a.needed + 30 * 14 == 472 and whole.fits and whole.extrapolated_from == (2, 4)
    assert whole.arguments == 260 and whole.cost["flops"] == 32.0
    assert whole.compile_seconds == 4.0 and whole.host_peak_rss_bytes == 90  # what was spent here, not a guess
    assert "extrapolated: the whole step was too big to compile" in format_compile(whole, 480, {}, None)
    assert cost_bounds(whole, 1.0)["reported"]
    scanned = cost_bounds(whole, 1.0, scanned=True)  # a loop's body counted once: no bound drawn
    assert not scanned["reported"] and "counts the scanned layer once" in format_compile(whole, 480, scanned, None)
    refused = replace(b, refused=out_of_memory("Ran out of memory in memory space hbm. Used 20.00G of 15.75G hbm."))
    assert not extrapolate({2: a, 4: refused}, 32).fits  # too big at 4 layers: too big at 32


def test_a_multimodal_config_is_cut_in_its_text_decoder(tmp_path):
    """Gemma 3 4B as the Hub ships it: the layers are the text_config's, and its per-layer attention list
    (the class fills layer_types in) keeps its first entries."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.memory.tpu_layers import cut, layers_of

    recipe = load_recipe("recipes/gemma3_4b_lora_v5e1.yaml", ["runtime.device=tpu"])
    two = cut(recipe, 2, tmp_path)
    config = json.loads((tmp_path / "layers-2" / "config.json").read_text())
    assert layers_of(recipe) == 34 and layers_of(two) == 2 and "num_hidden_layers" not in config
    assert config["text_config"]["num_hidden_layers"] == 2 and len(config["text_config"]["layer_types"]) == 2
    assert config["vision_config"]["num_hidden_layers"] == 27  # the vision tower is kept whole


def test_a_compile_past_its_time_is_stopped_and_the_child_never_outlives_the_wait():
    from lowmem_tpu.memory.tpu_compile import CompileTooLong, _watch

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(CompileTooLong, match="took over 1 s"):
        _watch(child, 1.0)
    assert child.poll() is not None  # killed, not left running


WATCHED = """
import sys, threading, torch, torch_xla
from pathlib import Path
from lowmem_tpu.memory.trace import ProgramWatcher
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


def test_the_program_key_follows_what_the_compiler_does_not_its_prose(tmp_path, monkeypatch):
    from lowmem_tpu.memory.tpu_compile import compiler_fingerprint

    source = Path(tpu_compile.tpu_compiler_source()).read_text()
    reworded = tmp_path / "reworded.py"
    reworded.write_text(
        source.replace('"""The TPU compiler without a TPU', '"""Reworded: the TPU compiler', 1) + "\n# a note\n"
    )
    changed = tmp_path / "changed.py"
    changed.write_text(source + "\nEXTRA = 1\n")
    keys = {}
    for name, path in (("as is", tpu_compile.tpu_compiler_source()), ("reworded", reworded), ("changed", changed)):
        monkeypatch.setattr(tpu_compile, "tpu_compiler_source", lambda path=path: str(path))
        keys[name] = compiler_fingerprint()
    assert keys["as is"] == keys["reworded"] != keys["changed"]
