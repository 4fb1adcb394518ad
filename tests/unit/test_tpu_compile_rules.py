"""``lowmem-tpu memory --compile`` without compiling: the fit arithmetic, the module header and placeholder
sharding rules, the refusals, the cut of a step too big to compile here and its extrapolation, the compile's
time limit and the program key (the real TPU compiler on the tiny recipe: e2e/test_tpu_compile.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from cli_runs import compiler_cli as cli
from markers import needs_compiler

from lowmem_tpu.errors import UserError
from lowmem_tpu.measure import tpu_compile
from lowmem_tpu.measure.buffers import out_of_memory
from lowmem_tpu.measure.libtpu import buffer_donors, fsdp_sharding
from lowmem_tpu.measure.tpu_compile import TpuCompile, compile_target
from lowmem_tpu.measure.tpu_report import format_compile, step_estimate

TINY = "recipes/tiny_lora_cpu.yaml"
pytestmark = needs_compiler


def test_the_fit_arithmetic_and_a_refusal_read_as_does_not_fit():
    gib = 2**30
    base = TpuCompile("v5e-1", "v5e:1x1", 1, 16 * gib, "0.0.21", "TPU v5 lite", 1.0, 2.0, 0, 3, 2)
    ok = replace(base, arguments=6 * gib, outputs=4 * gib, aliased=3 * gib, temporaries=8 * gib)
    assert ok.needed == 15 * gib and ok.free == gib and ok.fits  # a GiB kept free: just
    assert not replace(ok, outputs=4 * gib + 1).fits  # outputs count, though the compiler's refusal does not
    assert not replace(ok, generated_code=2**20).fits  # and so does the program's code
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
    unknown = cli("memory", TINY, "--compile", "--target", "v9-8")
    assert unknown.returncode == 2 and "unknown device 'v9-8'" in unknown.stderr and "v5e-8" in unknown.stderr
    legacy = cli("memory", TINY, "--compile", "--target", "v3-8")
    assert legacy.returncode == 2 and "no v3-8" in legacy.stderr
    split = cli("memory", TINY, "train.global_batch_size=12", "--compile", "--target", "v5e-8")
    assert split.returncode == 2 and "12" in split.stderr and "Traceback" not in split.stderr
    assert "tracing" not in split.stderr  # refused before the trace is announced
    flash = cli("memory", TINY, "model.attn_implementation=flash", "--compile", "--target", "v5e-8")  # 24 tokens
    assert flash.returncode == 2 and "24 cannot be tiled" in flash.stderr and "Traceback" not in flash.stderr
    with pytest.raises(UserError, match=r"unknown device 'nope'"):
        compile_target("nope")
    monkeypatch.setattr(tpu_compile.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"\.\[compiler\]"):
        tpu_compile.require_compiler()


def test_a_step_too_big_to_compile_here_is_the_line_through_2_and_4_layers(tmp_path):
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.measure.tpu_layers import cut, extrapolate, layers_of

    recipe = load_recipe("recipes/open_llama_7b_qlora.yaml", ["runtime.device=tpu"])
    two = cut(recipe, 2, tmp_path)
    assert layers_of(recipe) == 32 and layers_of(two) == 2 and two.model.quantize == "nf4"
    assert json.loads((tmp_path / "layers-2" / "config.json").read_text())["hidden_size"] == 4096

    base = TpuCompile("v5e-1", "v5e:1x1", 1, 16 * 2**30, "0.0.21", "TPU v5 lite", 1.0, 2.0, 50, 30, 28)
    kernel = {"name": "_flash_attention_dq_kernel", "hbm_bytes": 10, "flops": None, "shapes": [[1, 2, 128, 128]]}
    step_a = {"cycles": 3_000_000, "flops": 2e9, "hbm_bytes": 1e6, "kernels": [kernel | {"runs": 2}]}
    step_b = {"cycles": 5_000_000, "flops": 4e9, "hbm_bytes": 2e6, "kernels": [kernel | {"runs": 4}]}
    a = replace(base, arguments=20, outputs=10, aliased=8, temporaries=30, cost={"flops": 2.0}, step=step_a)
    b = replace(base, arguments=36, outputs=18, aliased=14, temporaries=40, cost={"flops": 4.0}, step=step_b)
    b = replace(b, host_peak_rss_bytes=90)
    whole = extrapolate({4: b, 2: a}, 32)  # per layer: 8 + 4 - 3 + 5 = 14 needed, from 52 at 2 layers
    assert whole.needed == a.needed + 30 * 14 == 472 and whole.fits and whole.extrapolated_from == (2, 4)
    assert whole.arguments == 260 and whole.cost["flops"] == 32.0
    assert whole.compile_seconds == 4.0 and whole.host_peak_rss_bytes == 90  # what was spent here, not a guess
    assert "extrapolated: the whole step was too big to compile" in format_compile(whole, 480, {}, None)
    # The step's sums and each kernel's runs are on the line too: 1 M cycles and 2 runs per layer.
    assert whole.step["cycles"] == 3_000_000 + 30 * 1_000_000 and whole.step["kernels"][0]["runs"] == 32
    estimate = step_estimate(whole, 1e12, 4096, 0.5)
    kernel_time = 32 * 3 * 2.0 * 2 * 128 * 128 * 128 / 197e12  # dq's three matmuls at the MXU's peak
    assert estimate["step_seconds"] == pytest.approx(33e6 / 1.5e9 + kernel_time)
    assert estimate["mfu"] == pytest.approx(1e12 / estimate["step_seconds"] / 197e12)
    assert estimate["useful_tokens_per_second_per_chip"] == pytest.approx(2048 / estimate["step_seconds"])
    text = format_compile(whole, 480, estimate, None)
    assert "by libtpu's cost model" in text and "Pallas kernels, by flops at the MXU's peak" in text
    unknown = step_estimate(replace(whole, step={}), 1e12, 4096, None)
    assert not unknown["reported"] and "compile it again" in format_compile(whole, 480, unknown, None)
    refused = replace(b, refused=out_of_memory("Ran out of memory in memory space hbm. Used 20.00G of 15.75G hbm."))
    assert not extrapolate({2: a, 4: refused}, 32).fits  # too big at 4 layers: too big at 32


def test_a_multimodal_config_is_cut_in_its_text_decoder(tmp_path):
    """Gemma 3 4B as the Hub ships it: the layers are the text_config's, and its per-layer attention list
    (the class fills layer_types in) keeps its first entries."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.measure.tpu_layers import cut, layers_of

    recipe = load_recipe("recipes/gemma3_4b_lora_v5e1.yaml", ["runtime.device=tpu"])
    two = cut(recipe, 2, tmp_path)
    config = json.loads((tmp_path / "layers-2" / "config.json").read_text())
    assert layers_of(recipe) == 34 and layers_of(two) == 2 and "num_hidden_layers" not in config
    assert config["text_config"]["num_hidden_layers"] == 2 and len(config["text_config"]["layer_types"]) == 2
    assert config["vision_config"]["num_hidden_layers"] == 27  # the vision tower is kept whole


def test_a_step_recomputing_one_layer_in_k_is_cut_at_k_and_2k_layers():
    """Between the two cuts the layers must hold one recomputed layer in K, as the whole model's do: with every_4
    at 2 and 4 layers both added layers are kept, and the line put Open Llama 3B's full step 1.3 GiB over its
    whole compile and 10% faster."""
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.measure.tpu_layers import layer_points

    def points(policy: str) -> tuple[int, int]:
        recipe = load_recipe("recipes/open_llama_full.yaml", [f"sharding.activation_checkpointing={policy}"])
        return layer_points(recipe)

    assert points("true") == points("false") == points("every_2") == (2, 4)
    assert points("every_3") == (3, 6) and points("every_4") == (4, 8)


def test_a_compile_past_its_time_is_stopped_and_the_child_never_outlives_the_wait():
    from lowmem_tpu.measure.tpu_compile import CompileTooLong, _watch

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(CompileTooLong, match="took over 1 s"):
        _watch(child, 1.0)
    assert child.poll() is not None  # killed, not left running


def test_the_program_key_follows_what_the_compiler_does_not_its_prose(tmp_path, monkeypatch):
    from lowmem_tpu.measure.tpu_compile import compiler_fingerprint

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
