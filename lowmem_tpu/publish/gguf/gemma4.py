"""Gemma 4 as llama.cpp's ``gemma4``: what differs from the families ``metadata`` and ``writer`` describe.

Its layers are of two kinds: sliding ones (``head_dim``, ``num_key_value_heads``) and full ones
(``global_head_dim``; with ``attention_k_eq_v`` their own KV heads and no v_proj: llama.cpp takes V from K
when a layer has no ``attn_v``). The full layers rotate a quarter of each head (proportional rope), which
llama.cpp reads as a ``rope_freqs`` tensor of ones for the rotated pairs and 1e30 (no rotation) for the
rest. Per-layer arrays carry the KV heads and the MLP width where they differ (the K/V-reusing layers'
double-wide MLP); ``shared_kv_layers`` the layers that reuse earlier ones' K/V. Norms are stored as they
are (Gemma 4 scales by the weight, not 1 + weight) and nothing is permuted; ``layer_scalar`` is the
layer's ``layer_output_scale``. 26B-A4B's experts stay fused (``ffn_gate_up_exps``) beside the dense MLP,
the router's ``scale`` and ``per_expert_scale`` as ``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``.
This is what llama.cpp's own converter (``Gemma4Model``) writes, checked by reading the files back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lowmem_tpu.errors import UserError

ARCH = "gemma4"
SKIPPED = ("model.audio_tower.", "model.embed_audio.", "model.embed_vision.")  # with the vision tower
RENAMED = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


def layer_of(text: Any, kind: str) -> Any:
    """The first layer of ``kind``'s config (transformers' ``per_layer_config``: its head size, KV heads and
    MLP width; the config's own fields are ambiguous where layers differ)."""
    return text.per_layer_config[list(text.layer_types).index(kind)]


def check(text: Any) -> None:
    """What llama.cpp's gemma4 cannot compute as transformers does, refused before any weight is read."""
    full = dict((getattr(text, "rope_parameters", None) or {}).get("full_attention") or {})
    sliding = dict((getattr(text, "rope_parameters", None) or {}).get("sliding_attention") or {})
    if full.get("rope_type", "default") not in ("default", "proportional") or sliding.get("rope_type", "default") != (
        "default"
    ):
        raise UserError(
            "this Gemma 4's rotary scaling is not one llama.cpp's gemma4 applies; no GGUF was written. Serve the "
            "merged safetensors model instead (vLLM)"
        )
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    first = text.num_hidden_layers - shared
    kinds = list(text.layer_types)
    if shared and (kinds[first - 1] != "full_attention" or kinds[first - 2] != "sliding_attention"):
        raise UserError(
            "llama.cpp's gemma4 reads the reused K/V from the last layers before the shared ones (a sliding "
            "layer, then a full one); this model's are laid out otherwise, so no GGUF was written. Serve the "
            "merged safetensors model instead (vLLM)"
        )


def add_hyperparameters(writer: Any, text: Any) -> list[tuple[str, np.ndarray]]:
    """The gemma4 keys; returns the ``rope_freqs`` tensor of the full layers' partial rotation."""
    n = text.num_hidden_layers
    kinds = [kind == "sliding_attention" for kind in text.layer_types]
    full, sliding = layer_of(text, "full_attention"), layer_of(text, "sliding_attention")
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(n)
    writer.add_head_count(text.num_attention_heads)
    kv = [text.per_layer_config[i].num_key_value_heads for i in range(n)]
    writer.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    wide = 2 if getattr(text, "use_double_wide_mlp", False) else 1
    widths = [text.per_layer_config[i].intermediate_size * (wide if i >= n - shared else 1) for i in range(n)]
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(sliding.head_dim)
    writer.add_value_length_swa(sliding.head_dim)
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(sliding.head_dim)
    rope = text.rope_parameters
    writer.add_rope_freq_base(float(rope["full_attention"].get("rope_theta", 1e6)))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"].get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_vocab_size(text.vocab_size)
    writer.add_sliding_window(int(text.sliding_window))
    writer.add_sliding_window_pattern(kinds)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(getattr(text, "hidden_size_per_layer_input", 0) or 0)
    if getattr(text, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(text.final_logit_softcapping))
    if getattr(text, "enable_moe_block", False):
        writer.add_expert_count(text.num_experts)
        writer.add_expert_used_count(text.top_k_experts)
        writer.add_expert_feed_forward_length(text.moe_intermediate_size)
    factor = float(rope["full_attention"].get("partial_rotary_factor", 1.0))
    pairs, rotated = full.head_dim // 2, int(full.head_dim * factor / 2)
    freqs = np.full(pairs, 1e30, dtype=np.float32)
    freqs[:rotated] = 1.0
    return [("rope_freqs.weight", freqs)]


def tensor_name(name: str, names: Any) -> str | None:
    """The GGUF name of a Gemma 4 decoder tensor (transformers' name, the text model unwrapped)."""
    layer, _, leaf = name.rpartition(".layers.")[2].partition(".")
    if leaf in RENAMED:
        return f"blk.{layer}.{RENAMED[leaf]}"
    if leaf in ("layer_scalar", "experts.gate_up_proj", "experts.down_proj"):  # stored without ".weight"
        name = f"{name}.weight"
    return names.get_name(name, try_suffixes=(".weight", ".bias"))
