"""A tiny Llama with a chosen attention implementation (test_lever_settings, test_levers)."""

from __future__ import annotations

import torch

from lowmem_tpu.model import attention


def tiny_llama(impl: str, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    attention.register(impl)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attention.transformers_name(impl),
    )  # head size 10 (not a multiple of anything), grouped-query attention
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
