"""The model: config and weights (``build``), ``tokenizer``, ``lora``, a quantized base (``quantize``; ``nf4``
and ``nibbles`` for its 4-bit layouts), ``architecture`` (facts without weights), and the implementations a
recipe switches on: ``experts`` (MoE layers at static shapes; ``stacks`` reads per-expert checkpoints,
``mxfp4`` gpt-oss's 4-bit experts),
``attention`` (chunked), ``loss`` (chunked), ``rope`` (rotary by a matmul), ``ordering``
(one block after another); ``names`` keeps clean parameter names.

Imports ``config`` and ``errors`` only, never ``xla``: what lives here runs on the host. torch,
transformers and peft are imported inside the functions that need them.
"""

from lowmem_tpu.model.architecture import check_attention, check_model, count_parameters, flops_per_token, layer_class
from lowmem_tpu.model.build import (
    build_base_model,
    load_config,
    meta_model,
    quantize_base,
    resolve_source,
    shipped_config_path,
    torch_dtype,
)
from lowmem_tpu.model.lora import apply_lora
from lowmem_tpu.model.tokenizer import align_special_tokens, check_vocabulary, load_tokenizer, save_tokenizer

__all__ = [
    "align_special_tokens",
    "apply_lora",
    "build_base_model",
    "check_attention",
    "check_model",
    "check_vocabulary",
    "count_parameters",
    "flops_per_token",
    "layer_class",
    "load_config",
    "load_tokenizer",
    "meta_model",
    "quantize_base",
    "resolve_source",
    "save_tokenizer",
    "shipped_config_path",
    "torch_dtype",
]
