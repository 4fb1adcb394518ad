"""The TPU-only paths, traced and compiled for a TPU on this CPU machine (the CPU backend cannot run them).

flash attention's Pallas kernel is lowered for the TPU (``lowmem_tpu.xla.pallas``) and the step that
uses it compiled by libtpu's compile-only client. What the TPU-only settings cost at a real model's width
(flash against eager and chunked, dropout's bits partitioned by the libtpu flag or not, quantized bases) is a
measurement: benchmarks/tpu_only_paths.py and its record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import compiler_cli as cli
from markers import needs_compiler

from lowmem_tpu.config.checks import flash_tiles

ROOT = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny_lora_cpu.yaml"
pytestmark = needs_compiler

# torch_xla's flash forward and backward on [2, 2, L, 128], the kernels lowered for a TPU: one line per length.
LENGTHS_SCRIPT = """
import sys, torch, torch_xla
from lowmem_tpu.xla.pallas import lower_pallas_for_tpu
lower_pallas_for_tpu()
from torch_xla.experimental.custom_kernel import flash_attention
for length in map(int, sys.argv[1:]):
    q, k, v = (torch.randn(2, 2, length, 128, device=torch_xla.device(), requires_grad=True) for _ in range(3))
    segments = torch.ones(2, length, device=torch_xla.device())
    try:
        flash_attention(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments).sum().backward()
        text = torch_xla._XLAC._get_xla_tensors_text([q.grad, k.grad, v.grad])
        print(length, "traced", text.count("tpu_custom_call"))
    except Exception as err:
        print(length, "refused", str(err).splitlines()[-1][:120])
"""


def test_flash_backward_traces_for_a_tpu_at_exactly_the_lengths_the_recipe_accepts():
    """The recipe's flash length check against the kernel itself: forward, dq and dkv lowered for a TPU."""
    lengths = [64, 100, 128, 192, 256, 384, 512, 640, 768, 1024, 1536, 2048]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", LENGTHS_SCRIPT, *map(str, lengths)], env=env, capture_output=True, text=True, timeout=600
    )
    results = {int(line.split()[0]): line.split()[1:] for line in done.stdout.splitlines() if line[:1].isdigit()}
    assert sorted(results) == lengths, done.stderr[-2000:]
    traced = [n for n in lengths if results[n][0] == "traced"]
    assert traced == [n for n in lengths if flash_tiles(n)] == [128, 256, 512, 1024, 2048]
    assert all(results[n][1] == "3" for n in traced)  # forward, dq, dkv: three TPU kernels


@pytest.fixture(scope="module")
def flash_step() -> dict:
    """The tiny recipe in bf16 with flash at 128 tokens, compiled for Kaggle's v5e-8."""
    over = ["model.attn_implementation=flash", "data.max_length=128", "model.dtype=bfloat16"]
    done = cli("memory", TINY, "--compile", "--target", "v5e-8", "--json", *over)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_flash_step_compiles_for_a_tpu_with_its_kernels(flash_step):
    layers = json.loads((ROOT / "lowmem_tpu/assets/tiny-llama/config.json").read_text())["num_hidden_layers"]
    # Each layer: the forward kernel, its recomputation under checkpointing, and the two backward kernels.
    assert flash_step["kernels"] == 4 * layers
    assert flash_step["fits"] and flash_step["needed"] > 0 and flash_step["scratch"] > 0


def test_a_moe_step_compiles_for_a_tpu_with_megablox_grouped_matmuls(stand_ins):
    """LoRA on the Qwen 3 MoE stand-in's experts: each layer's two projections run megablox's gmm forward, again
    in the checkpointed recomputation, and gmm (the rows') and tgmm (the stack's, as PEFT folds LoRA into it)
    backward: 8 kernels a layer, compiled by libtpu for Kaggle's v5e-8."""
    over = [f"model.name_or_path={stand_ins['qwen3_moe']}", "model.dtype=bfloat16"]
    done = cli("memory", TINY, "--compile", "--target", "v5e-8", "--json", *over)
    assert done.returncode == 0, done.stderr[-3000:]
    step = json.loads(done.stdout)
    assert step["fits"] and step["kernels"] == 8 * 2
