"""gpt-oss as llama.cpp's ``gpt-oss``: its experts and keys as llama.cpp's converter (``GptOssModel``) writes them.

transformers keeps a layer's experts transposed (``gate_up_proj`` [experts, hidden, 2 x inner], gate and up
interleaved by column; ``down_proj`` [experts, inner, hidden]) with a bias per expert output. llama.cpp
reads them as ``ffn_gate_exps``/``ffn_up_exps`` [experts, inner, hidden] (the even and odd columns, as rows)
and ``ffn_down_exps`` [experts, hidden, inner], each with its bias; the attention sinks as ``attn_sinks``. Its
yarn rotary scaling is written as keys; the clamped SwiGLU (alpha 1.702, limit 7) and the sliding window on
every other layer, starting with the first, are llama.cpp's own for this architecture. The experts are
written in the file's type, not MXFP4 (llama.cpp's CPU kernels round the activations of an MXFP4 product to
8 bits).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lowmem_tpu.errors import UserError

ARCH = "gpt-oss"
SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}  # what llama.cpp computes for every gpt-oss


def check(text: Any) -> None:
    """What llama.cpp's gpt-oss computes otherwise, refused before any weight is read."""
    for key, value in SWIGLU.items():
        if abs(float(getattr(text, key, value)) - value) > 1e-6:
            raise UserError(
                f"llama.cpp's gpt-oss computes its experts' SwiGLU with {key} {value}; this model's is "
                f"{getattr(text, key)}, so no GGUF was written. Serve the merged safetensors model instead (vLLM)"
            )
    kinds = list(getattr(text, "layer_types", None) or [])
    if kinds != [("sliding_attention", "full_attention")[i % 2] for i in range(len(kinds))]:
        raise UserError(
            "llama.cpp's gpt-oss slides every other layer, starting with the first; this model's layers are laid "
            "out otherwise, so no GGUF was written. Serve the merged safetensors model instead (vLLM)"
        )
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise UserError(
            f"GGUF export writes gpt-oss's yarn rotary scaling; this model's is {rope.get('rope_type')!r}. Serve "
            "the merged safetensors model instead (vLLM)"
        )


def add_hyperparameters(writer: Any, text: Any) -> None:
    from gguf import RopeScalingType

    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_vocab_size(text.vocab_size)
    writer.add_expert_count(text.num_local_experts)
    writer.add_expert_used_count(text.num_experts_per_tok)
    writer.add_expert_feed_forward_length(text.intermediate_size)
    writer.add_sliding_window(int(text.sliding_window))
    rope = dict(text.rope_parameters)
    writer.add_rope_dimension_count(text.head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 150000.0)))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def experts_split(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers' expert tensors as llama.cpp's: the interleaved gate/up stack and its bias split into the
    gate (even) and up (odd) outputs, every stack as [experts, out, in]; the sinks under a weight's name."""
    for name, tensor in tensors:
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            yield f"{base}gate_proj.weight", tensor[..., 0::2].transpose(1, 2)
            yield f"{base}up_proj.weight", tensor[..., 1::2].transpose(1, 2)
        elif name.endswith(".experts.gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            yield f"{base}gate_proj.bias", tensor[..., 0::2]
            yield f"{base}up_proj.bias", tensor[..., 1::2]
        elif name.endswith(".experts.down_proj"):
            yield f"{name}.weight", tensor.transpose(1, 2)
        elif name.endswith(".experts.down_proj_bias"):
            yield name.removesuffix("_bias") + ".bias", tensor
        elif name.endswith(".self_attn.sinks"):
            yield f"{name}.weight", tensor
        else:
            yield name, tensor
