"""Tiny stand-ins of the model families people fine-tune, built from nothing.

Each is its family's config.json as the Hub ships it, shrunk (hidden 64, 2 layers, vocab 512), with the
structural features that change what a loader or a kernel must do kept: grouped-query attention, tied
embeddings (Gemma leaves ``tie_word_embeddings`` out: the class default, true, applies), q/k/v biases
(Qwen 2.5), q/k norms (Qwen 3, Gemma 3), a head size that is not hidden / heads (Gemma, Qwen 3),
attention and final-logit soft-capping (Gemma 2), sliding windows shorter than the test rows (Gemma 2/3,
Mistral, Phi-3), llama3 rope scaling, fused ``qkv_proj`` and ``gate_up_proj`` (Phi), the multimodal
wrapper Gemma 3 4B and up ships as, EOS lists (Llama 3, Gemma) and routed experts stored one key per expert
(Qwen 3 MoE). Weights are random.

    python tests/helpers/families.py             # the stand-ins' names and end-of-turn texts, as JSON
    python tests/helpers/families.py NAME DIR    # build one in DIR (benchmarks/family_matrix.py runs both)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from family_tokenizers import make_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 8  # shorter than the test rows, so a window changes what a query sees
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": [2, 3, 4],
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    # Qwen3-30B-A3B's layout: every layer's MLP is 8 routed experts (128 there), 2 per token (8 there),
    # stored as the Hub stores them, one key per expert and projection
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "bos_token_id": 1,
        "decoder_sparse_step": 1,
        "eos_token_id": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attention_bias": False,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": WINDOW,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": WINDOW - 1,
        "tie_word_embeddings": False,
    },
    "phi4": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "bos_token_id": 500,
        "eos_token_id": 501,
        "hidden_act": "silu",
        "max_position_embeddings": 16384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "original_max_position_embeddings": 16384,
        "pad_token_id": 600,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 250000,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # gpt-oss-20b's layout: attention sinks, sliding and full layers in turn, biases everywhere, 4 routed
    # experts (32 there), 2 per token, their interleaved gate/up and down stacks stored as MXFP4 blocks and
    # scales (``mxfp4_experts``), yarn rope; the harmony special tokens at 500-512
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "eos_token_id": 502,
        "experts_per_token": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "initial_context_length": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "output_router_logits": False,
        "pad_token_id": 501,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": WINDOW,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
    },
}
# Gemma 3 4B and up: the multimodal checkpoint (its own text_config and a vision tower).
GEMMA3_MULTIMODAL = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 4,
    "text_config": {**FAMILIES["gemma3"], "model_type": "gemma3_text", **SMALL},
    "vision_config": {
        "hidden_size": 32,
        "image_size": 32,
        "intermediate_size": 64,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "patch_size": 8,
        "vision_use_head": False,
    },
}
# Gemma 4 (E2B's layout, shrunk): the multimodal checkpoint; layers of two kinds (sliding: 16-wide heads, 2 KV
# heads; full: 32-wide heads, proportional rope), the last two reusing earlier layers' K/V (the double-wide
# MLP there), per-layer embeddings (PLE), final soft-capping.
GEMMA4 = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "audio_token_id": 601,
    "boi_token_id": 602,
    "eoi_token_id": 603,
    "eos_token_id": [1, 106],
    "image_token_id": 600,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma4_text",
        **SMALL,
        "num_hidden_layers": 6,
        "vocab_size": 640,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 32,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 16,
        # the last layer before the K/V-reusing ones full, the one before it sliding, as E2B has them
        "layer_types": ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "num_attention_heads": 4,
        "num_global_key_value_heads": None,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 2,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": WINDOW,
        "use_double_wide_mlp": True,
        "vocab_size_per_layer_input": 640,
    },
    "vision_config": {
        "model_type": "gemma4_vision",
        "global_head_dim": 16,
        "head_dim": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "patch_size": 8,
        "pooling_kernel_size": 2,
        "position_embedding_size": 64,
    },
    "audio_config": None,
}
# Gemma 4 26B-A4B's layout, shrunk: a dense MLP and routed experts side by side in every layer (the router's
# own norm, scale and per-expert scale), full layers with K = V and their own KV heads, no per-layer
# embeddings or K/V sharing.
GEMMA4_MOE = {
    **GEMMA4,
    "text_config": {
        **GEMMA4["text_config"],
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
}
NAMES = tuple(FAMILIES)
# the Hub's multimodal checkpoints
WRAPPED = {"gemma3_multimodal": GEMMA3_MULTIMODAL, "gemma4": GEMMA4, "gemma4_moe": GEMMA4_MOE}
ALL_NAMES = (*NAMES, *WRAPPED)


def family_config(name: str) -> dict[str, Any]:
    """The family's config.json, shrunk (the multimodal ones in the Hub's layout)."""
    if name in WRAPPED:
        return json.loads(json.dumps(WRAPPED[name]))
    config = {**FAMILIES[name], **SMALL}
    if name in ("phi4", "gemma2", "gemma3", "gpt_oss"):
        config["vocab_size"] = 640  # embeddings with more rows than the tokenizer has tokens
    return config


def make_family(path: Path, name: str, seed: int = 0) -> Path:
    """A random-init stand-in saved as the Hub ships the family (config.json, safetensors, generation_config)."""
    path.mkdir(parents=True, exist_ok=True)
    raw = family_config(name)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms moved off their init (ones, or zeros for Gemma), so a re-initialised one shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    if raw.get("quantization_config", {}).get("quant_method") == "mxfp4":
        mxfp4_experts(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(raw, indent=2))  # as the Hub has it, defaults left out
    eos = raw.get("eos_token_id", raw.get("text_config", {}).get("eos_token_id"))
    generation = {"bos_token_id": raw.get("bos_token_id", 2), "eos_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    make_tokenizer(path, name)
    return path


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 by nibble


def mxfp4_experts(file: Path) -> None:
    """The expert stacks rewritten as the Hub's MXFP4 (OCP microscaling): each output row's inputs in blocks
    of 32, a power-of-two scale per block (a byte, exponent + 127) and two 4-bit E2M1 codes per byte, the
    even element in the low nibble; ``{stack}_blocks`` [experts, out, in / 32, 16], ``{stack}_scales``."""
    from safetensors.torch import load_file, save_file

    tensors, codes = load_file(file), torch.tensor(FP4)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).float().transpose(1, 2)  # stored [E, in, out]: the Hub's rows are outputs
        groups = rows.reshape(*rows.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-120) / 6.0))
        scaled = groups / torch.exp2(exponent)[..., None]
        nibbles = (scaled[..., None] - codes).abs().argmin(-1).to(torch.uint8)
        tensors[f"{name}_blocks"] = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        tensors[f"{name}_scales"] = (exponent + 127).to(torch.uint8)
    save_file(tensors, file, metadata={"format": "pt"})


if __name__ == "__main__":
    import sys

    from family_tokenizers import END_OF_TURN

    if len(sys.argv) == 3:
        print(make_family(Path(sys.argv[2]), sys.argv[1]))
    else:
        print(json.dumps({name: END_OF_TURN.get(name) for name in ALL_NAMES}))
