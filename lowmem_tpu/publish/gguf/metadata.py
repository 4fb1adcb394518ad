"""GGUF metadata: the families GGUF export describes, an architecture's hyper-parameters as llama.cpp reads
them, and the tokenizer.

What llama.cpp does not read from a file it assumes, so a model whose config differs from that is refused
rather than written to compute something else: Gemma's attention scale (llama.cpp: 1 / sqrt(head_dim),
or 1 / sqrt(hidden / heads) for the 27B models), rotary scaling other than linear and Llama 3's. Phi-3's
sliding window is the one difference written anyway: llama.cpp attends over the whole context there (as
the model does up to its window), and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.gguf import gemma4, gpt_oss
from lowmem_tpu.publish.gguf.vocab import read_vocab, special_ids


@dataclass(frozen=True)
class Family:
    """How one transformers model type is written for llama.cpp."""

    arch: str  # gguf's architecture name
    interleave_qk: bool = False  # llama.cpp's LLAMA rotates adjacent pairs, transformers' halves
    norm_plus_one: bool = False  # Gemma scales by 1 + weight; llama.cpp by the stored weight


FAMILIES = {
    "llama": Family("llama", interleave_qk=True),
    "mistral": Family("llama", interleave_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen3_moe": Family("qwen3moe"),
    "gemma2": Family("gemma2", norm_plus_one=True),
    "gemma3_text": Family("gemma3", norm_plus_one=True),
    "gemma4_text": Family("gemma4"),  # its layers' differences: publish/gguf/gemma4.py
    "gpt_oss": Family("gpt-oss"),  # its experts and keys: publish/gguf/gpt_oss.py
    "phi3": Family("phi3"),
}


def family_of(config: Any) -> tuple[Family, Any]:
    """The family and the text config of a model config; a family GGUF export does not describe is refused."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = FAMILIES.get(text.model_type)
    if family is None:
        raise UserError(
            f"GGUF export does not describe the model type {text.model_type!r}; it writes "
            f"{', '.join(sorted(FAMILIES))}. Serve the merged safetensors model instead (vLLM, transformers)"
        )
    return family, text


GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales these models' queries by hidden / heads


def head_dim(text: Any) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _rope(text: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full-attention rotary parameters, and the sliding layers' where they differ (Gemma 3)."""
    params = dict(getattr(text, "rope_parameters", None) or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), params.get("sliding_attention")
    if not params:  # a config from before rope_parameters
        params = {"rope_theta": getattr(text, "rope_theta", 10000.0), **(getattr(text, "rope_scaling", None) or {})}
    return params, None


def check_describable(config: Any) -> None:
    """Everything that refuses a model, checked on its config alone (before any weights are read)."""
    family, text = family_of(config)
    if family.arch == gemma4.ARCH:
        return gemma4.check(text)
    if family.arch == gpt_oss.ARCH:
        return gpt_oss.check(text)
    rope, sliding_rope = _rope(text)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear") and not (kind == "llama3" and family.arch == "llama"):
        raise UserError(
            f"GGUF export writes linear and Llama 3 rotary scaling; this model's is {kind!r}, which llama.cpp "
            "would read differently from transformers. Serve the merged safetensors model instead (vLLM)"
        )
    if family.arch == "qwen3moe":
        _qwen3moe_routing(text)
    if family.arch in GEMMA_27B_LAYERS:
        _gemma_scale(family.arch, text)
        if sliding_rope and sliding_rope.get("rope_type", "default") != "default":
            raise UserError(
                "the sliding layers' rotary scaling is not one llama.cpp applies; no GGUF was written. Serve the "
                "merged safetensors model instead (vLLM)"
            )


def _qwen3moe_routing(text: Any) -> None:
    """llama.cpp's qwen3moe routes every layer's tokens to experts and renormalizes the top-k weights."""
    dense = getattr(text, "mlp_only_layers", None) or []
    if dense or (getattr(text, "decoder_sparse_step", 1) or 1) != 1 or not getattr(text, "norm_topk_prob", True):
        raise UserError(
            "llama.cpp's qwen3moe puts experts in every layer and renormalizes the chosen experts' weights; this "
            "model has dense layers or keeps the weights as the router gives them, so no GGUF was written. Serve "
            "the merged safetensors model instead (vLLM)"
        )


def _gemma_scale(arch: str, text: Any) -> None:
    dim = head_dim(text)
    scalar = getattr(text, "query_pre_attn_scalar", None) or dim
    big = text.num_hidden_layers == GEMMA_27B_LAYERS[arch]
    expected = text.hidden_size / text.num_attention_heads if big else dim
    if not math.isclose(scalar, expected):
        raise UserError(
            f"query_pre_attn_scalar is {scalar}, but llama.cpp scales {arch} queries by 1/sqrt({expected:g}) "
            "for a model of this shape; a GGUF would compute other attention, so none was written. Serve the "
            "merged safetensors model instead (vLLM)"
        )


def add_hyperparameters(writer: Any, family: Any, text: Any) -> list[tuple[str, np.ndarray]]:
    """Write the architecture's keys; returns extra tensors llama.cpp reads (rotary factors)."""
    if family.arch == gemma4.ARCH:
        return gemma4.add_hyperparameters(writer, text)
    if family.arch == gpt_oss.ARCH:
        gpt_oss.add_hyperparameters(writer, text)
        return []
    dim = head_dim(text)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_vocab_size(text.vocab_size)
    if family.arch == "qwen3moe":
        writer.add_expert_count(text.num_experts)
        writer.add_expert_used_count(text.num_experts_per_tok)
        writer.add_expert_feed_forward_length(text.moe_intermediate_size)
    rope, sliding_rope = _rope(text)
    rotary = int(dim * rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None) or 1.0))
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    extra = _rope_scaling(writer, rope, rotary, family.arch)
    if family.arch in GEMMA_27B_LAYERS:
        _gemma(writer, family.arch, text, sliding_rope)
    elif family.arch == "phi3":
        writer.add_sliding_window(getattr(text, "sliding_window", None) or 0)
        if getattr(text, "original_max_position_embeddings", None):
            writer.add_rope_scaling_orig_ctx_len(text.original_max_position_embeddings)
    return extra


def notes(family: Any, text: Any) -> list[str]:
    """What llama.cpp computes differently from the model, within the file's limits (said in the report)."""
    window = getattr(text, "sliding_window", None)
    if family.arch in ("llama", "phi3") and window and window < text.max_position_embeddings:
        return [
            f"GGUF's {family.arch} architecture has no sliding window: llama.cpp (and transformers reading the file) "
            f"attends over the whole context where the model attends over a window of {window} tokens, so the two "
            f"agree on sequences up to {window} tokens and differ past that"
        ]
    return []


def _rope_scaling(writer: Any, rope: dict[str, Any], rotary: int, arch: str) -> list[tuple[str, np.ndarray]]:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return []
    if kind == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return []
    return [("rope_freqs.weight", _llama3_factors(rope, rotary))]  # llama3, on LLAMA: check_describable


def _llama3_factors(rope: dict[str, Any], rotary: int) -> np.ndarray:
    """Llama 3.1's per-frequency divisors (llama.cpp's ``rope_freqs``): 1 for short wavelengths, ``factor``
    for long ones, a smooth blend between (the same rule as transformers' llama3 rotary init)."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    context = float(rope["original_max_position_embeddings"])
    factors = []
    for freq in 1.0 / base ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary):
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _gemma(writer: Any, arch: str, text: Any, sliding_rope: dict[str, Any] | None) -> None:
    if getattr(text, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(float(text.attn_logit_softcapping))
    if getattr(text, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(text.final_logit_softcapping))
    window = getattr(text, "sliding_window", None)
    if window:
        writer.add_sliding_window(int(window))
        layer_types = getattr(text, "layer_types", None)
        if layer_types:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
    if sliding_rope:
        writer.add_rope_freq_base_swa(float(sliding_rope.get("rope_theta", 10000.0)))


def add_tokenizer(writer: Any, directory: Path, tokenizer: Any, config: Any, text: Any) -> str:
    """The vocabulary, special ids, BOS/EOS rules and chat template; returns the vocabulary's kind."""
    vocab = read_vocab(directory, tokenizer, text.vocab_size)
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    ids = special_ids(tokenizer, text)
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if name in ids:
            add(ids[name])
    writer.add_add_bos_token(adds_bos(tokenizer))
    writer.add_add_eos_token(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)
    return vocab.kind


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts BOS before a text (what llama.cpp must do too)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos
