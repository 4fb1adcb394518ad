"""Checks that involve several fields of a recipe (the schema checks each field on its own).

Each problem is (the dotted fields involved, a message naming the fix): ``config.messages`` drops
the ones a bad field would make spurious before it reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowmem_tpu.config.assets import BUILTIN, builtin_has_weights, looks_local
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.platform import on_tpu
from lowmem_tpu.config.rules import batch_split_problem

if TYPE_CHECKING:  # the schema calls these checks; they only read its types
    from lowmem_tpu.config.schema import DataSection, Recipe, ShardingSection


def cross_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """Problems that involve several fields, each as (the dotted fields involved, message)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    t, model, data = recipe.train, recipe.model, recipe.data
    batch = ("train.global_batch_size", "train.gradient_accumulation_steps")
    if t.global_batch_size % t.gradient_accumulation_steps:
        message = f"{t.global_batch_size} is not divisible by train.gradient_accumulation_steps"
        problems.append((batch, f"train.global_batch_size: {message} ({t.gradient_accumulation_steps})"))
    # On a TPU the device count is only known once torch_xla starts; the runtime checks it there.
    if not on_tpu(recipe.runtime.device):
        problem = batch_split_problem(
            t.global_batch_size, t.gradient_accumulation_steps, recipe.runtime.num_cpu_devices
        )
        if problem:
            problems.append(((*batch, "runtime.num_cpu_devices", "runtime.device"), problem))
    if model.name_or_path.startswith(BUILTIN) and not model.random_init and not builtin_has_weights(model.name_or_path):
        message = f"must be true for {model.name_or_path}, which ships a config and tokenizer but no weights"
        if "name_or_path" not in model.model_fields_set:
            message += " (it is the default model: set model.name_or_path to a Hub id or directory to use another)"
        problems.append((("model.name_or_path", "model.random_init"), f"model.random_init: {message}"))
    if model.quantize != "none" and not recipe.lora.enabled:
        message = (
            f"model.quantize: {model.quantize} freezes the base in {model.quantize}, but lora.enabled is false "
            "(full fine-tuning trains every base weight, which needs them in full precision); "
            "set lora.enabled: true to train LoRA adapters on the quantized base (QLoRA), or model.quantize: none"
        )
        problems.append((("model.quantize", "lora.enabled"), message))
    if model.quantize != "none" and recipe.sharding.scan_layers:
        message = (
            f"model.quantize: an {model.quantize} base is not supported with sharding.scan_layers yet "
            "(the scanned layer is traced functionally, the quantized projections are not); "
            "set sharding.scan_layers: false or model.quantize: none"
        )
        problems.append((("model.quantize", "sharding.scan_layers"), message))
    if model.attn_implementation == "flash" and not on_tpu(recipe.runtime.device):
        message = (
            "model.attn_implementation: flash is torch_xla's Pallas TPU kernel, which the CPU backend cannot run "
            '("Only interpret mode is supported on CPU backend"); use chunked (the same memory saving, any backend)'
        )
        problems.append((("model.attn_implementation", "runtime.device"), message))
    if model.attn_implementation == "flash" and not flash_tiles(data.max_length):
        below, above = flash_lengths_near(data.max_length)
        lengths = f"{below} or {above}" if below else str(above)
        message = (
            f"data.max_length: {data.max_length} cannot be tiled by flash attention's backward pass (torch_xla 2.9 "
            "picks blocks of min(1024, L), min(512, L) and min(256, L), which must divide L, in multiples of 128: "
            f"L = 128, 256, 512 or a multiple of 1024); use {lengths}, "
            "or model.attn_implementation: chunked (any length)"
        )
        problems.append((("data.max_length", "model.attn_implementation"), message))
    if data.packing and recipe.sharding.scan_layers and model.attn_implementation in ("chunked", "flash"):
        message = (
            f"data.packing: packed rows reach {model.attn_implementation} attention as segment ids, which the "
            "scanned layer (sharding.scan_layers) does not carry; use model.attn_implementation: sdpa or eager "
            "with scan_layers, or sharding.scan_layers: false"
        )
        problems.append((("data.packing", "sharding.scan_layers", "model.attn_implementation"), message))
    if t.chunked_loss and t.fused_lm_head:
        message = "train.chunked_loss: true and train.fused_lm_head: true are two ways to skip the logits; pick one"
        problems.append((("train.chunked_loss", "train.fused_lm_head"), message))
    problems += _sharding_problems(recipe.sharding)
    if recipe.hub.push and not recipe.hub.repo_id:
        problems.append((("hub.push", "hub.repo_id"), "hub.repo_id: required when hub.push is true (OWNER/NAME)"))
    held_out = data.eval_path or data.eval_fraction
    if t.eval_samples and not held_out:
        message = "train.eval_samples: needs data.eval_path or data.eval_fraction (held-out prompts to score)"
        problems.append((("train.eval_samples", "data.eval_path", "data.eval_fraction"), message))
    if t.eval_steps and not held_out:
        message = "train.eval_steps: needs data.eval_path or data.eval_fraction (without one nothing is evaluated)"
        problems.append((("train.eval_steps", "data.eval_path", "data.eval_fraction"), message))
    problems += _data_problems(data)
    return problems


def flash_tiles(length: int) -> bool:
    """Whether torch_xla 2.9's flash backward tiles this sequence length: 128, 256, 512 or a multiple of 1024.

    ``experimental/custom_kernel.py`` gives the dq kernel blocks of min(1024, L), min(512, L) and
    min(256, L), the dkv kernel min(512, L); JAX's Pallas kernel refuses a block that does not divide L
    and a key block that is not a multiple of 128 lanes (traced for a TPU: tests/e2e/test_tpu_only_paths.py).
    """
    return length % 128 == 0 and all(length % min(block, length) == 0 for block in (1024, 512, 256))


def flash_lengths_near(length: int) -> tuple[int | None, int]:
    """The nearest lengths below and above ``length`` that flash's backward tiles."""
    below = next((n for n in range(length, 0, -1) if flash_tiles(n)), None)
    above = next(n for n in range(length, 4 * length + 1025) if flash_tiles(n))
    return below, above


def target_problem(recipe: Recipe) -> str | None:
    """Why the batch cannot split over the devices of the recipe's ``runtime.target`` TPU (None: it can).

    Checked by ``validate`` and ``memory``, not at load: a run uses the devices it finds.
    """
    target = DEVICES.get(recipe.runtime.target or "")
    if target is None:
        return None
    t = recipe.train
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, target.devices)
    return f"{problem} (runtime.target: {target.name}, {target.devices} devices)" if problem else None


def _sharding_problems(sharding: ShardingSection) -> list[tuple[tuple[str, ...], str]]:
    problems: list[tuple[tuple[str, ...], str]] = []
    if sharding.checkpoint_every > 1 and sharding.scan_layers:
        message = (
            f"sharding.activation_checkpointing: {sharding.activation_checkpointing} checkpoints some layers, but "
            "sharding.scan_layers runs one compiled layer for all of them; use true or false with scan_layers"
        )
        problems.append((("sharding.activation_checkpointing", "sharding.scan_layers"), message))
    if sharding.offload_activations:
        message = (
            "sharding.offload_activations: host offload around each checkpointed layer (torch_xla 2.9's "
            "place_to_host/place_to_device) saves no HBM per the TPU compiler: open_llama_lora on v5e-8 needs "
            "3.74 GiB per chip with it and without, open_llama_full 8.41 against 8.46 GiB (XLA keeps the device "
            "copies live; docs/memory.md); use sharding.activation_checkpointing, model.attn_implementation: "
            "flash or chunked, or model.quantize, and set sharding.offload_activations: false"
        )
        problems.append((("sharding.offload_activations",), message))
    return problems


def _data_problems(data: DataSection) -> list[tuple[tuple[str, ...], str]]:
    problems: list[tuple[tuple[str, ...], str]] = []
    if data.eval_path and data.eval_fraction:
        message = "data.eval_fraction: held-out data is data.eval_path or a fraction of the training data, not both"
        problems.append((("data.eval_path", "data.eval_fraction"), message))
    if data.eval_path == data.path and (data.eval_split or data.split) == data.split:
        message = (
            f"data.eval_path: the same data and split as data.path ({data.split}): evaluation would score the "
            "training records; set data.eval_split to a held-out split, or drop data.eval_path and set "
            "data.eval_fraction"
        )
        problems.append((("data.eval_path", "data.eval_split", "data.path", "data.split"), message))
    if data.subset and (data.path.startswith(BUILTIN) or looks_local(data.path)):
        message = f"data.subset: {data.path} is a file; subsets (configurations) belong to Hub datasets"
        problems.append((("data.subset", "data.path"), message))
    return problems
