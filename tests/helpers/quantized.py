"""The int8 / int4 base as the one base builder reads it (test_quantize, test_quantize_training)."""

from __future__ import annotations

from lowmem_tpu.config import ModelSection
from lowmem_tpu.model import build_base_model


def load_quantized(path, method: str, group: int, lm_head: bool):
    """The one base builder reading a checkpoint, quantizing as it reads (float32, eager attention)."""
    section = ModelSection(
        name_or_path=str(path),
        dtype="float32",
        attn_implementation="eager",
        quantize=method,
        quantize_group_size=group,
        quantize_lm_head=lm_head,
    )
    return build_base_model(section)
