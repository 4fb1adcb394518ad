"""The recipe's ``model`` and ``lora`` sections: the base, its tokenizer and quantization, and the adapters
(LoRA and PEFT's variants of it). Nothing here imports torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from lowmem_tpu.config.assets import check_source
from lowmem_tpu.config.section import Section

# The projections of a Llama-family decoder layer: LoRA's default targets and what the planner knows.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Bits per weight of a quantized base (model.quantize).
QUANT_BITS = {"int8": 8, "int4": 4, "nf4": 4}


class ModelSection(Section):
    """The base model and its tokenizer."""

    name_or_path: str = Field(
        "builtin:tiny-llama",
        description="Hub id, local directory, or builtin:tiny-llama (a tiny Llama config shipped here).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the model.")
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Dtype of the weights: bfloat16 halves weight memory; TPUs compute in bf16."
    )
    random_init: bool = Field(
        False, description="Build the model from its config with random weights (nothing downloaded)."
    )
    adapter: str | None = Field(
        None,
        description="A trained LoRA adapter to start from (a run's final/, a PEFT adapter directory or Hub id): "
        "its own LoRA settings replace lora.*; with lowmem-tpu dpo a frozen copy of it is the reference.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path or Hub id; defaults to name_or_path.")
    use_fast_tokenizer: bool = Field(True, description="Fast (Rust) tokenizer; Open Llama asks for the slow one.")
    pad_token: str | None = Field(
        None,
        description="Pad token to use when the tokenizer has none (default: unk, else eos; "
        "padding is masked by position, so eos is still learned).",
    )
    attn_implementation: Literal["eager", "sdpa", "chunked", "flash"] = Field(
        "eager",
        description="Attention kernel. eager/sdpa keep [batch, heads, length, length] fp32 scores per live layer; "
        "chunked walks keys in blocks of 128 with an online softmax (no [length, length] tensor, any backend); "
        "flash is torch_xla's Pallas kernel (TPU only).",
    )
    quantize: Literal["none", "int8", "int4", "nf4"] = Field(
        "none",
        description="Freeze the base's decoder linears in int8 (one scale per output row), int4 "
        "(one scale per group of inputs, two per byte) or nf4 (QLoRA's 4-bit NormalFloat in bitsandbytes' "
        "arithmetic), quantized while loading; LoRA only (QLoRA).",
    )
    quantize_group_size: Literal[32, 64, 128, 256] = Field(
        64,
        description="int4: inputs sharing one scale; nf4: the block of one maximum (it must divide every "
        "linear's input width). Smaller = more accurate, more scales.",
    )
    quantize_double: bool | None = Field(
        None,
        description="nf4: quantize the block maxima to 8 bits too (QLoRA's double quantization, "
        "bitsandbytes' bnb_4bit_use_double_quant); on by default for nf4.",
    )
    quantize_lm_head: bool = Field(False, description="Quantize the LM head too (not when tied to the embedding).")

    @field_validator("dtype", mode="before")
    @classmethod
    def _no_fp16(cls, value: Any) -> Any:
        if str(value).lower() in {"float16", "fp16", "half", "torch.float16"}:
            raise ValueError("fp16 is not a TPU training dtype: TPUs train in bfloat16 (use model.dtype: bfloat16)")
        return value

    @field_validator("quantize", mode="before")
    @classmethod
    def _no_quantize(cls, value: Any) -> Any:
        return "none" if value is None or value is False else value

    @field_validator("name_or_path", "tokenizer", "adapter")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return None if value is None else check_source(value, "model")


class LoraSection(Section):
    """LoRA adapters (PEFT); disable for full-parameter fine-tuning."""

    enabled: bool = Field(True, description="Train LoRA adapters on a frozen base; false = full fine-tuning.")
    r: int = Field(16, gt=0, le=4096, description="LoRA rank: adapter memory grows linearly with r.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the LoRA input. 0 by default: on a TPU every layer's random bits are kept for "
        "the backward pass, checkpointed or not, which costs much memory per chip (the figure: "
        "`lowmem-tpu memory RECIPE lora.dropout=0.05 --compile`; docs/memory.md).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="Module names that get adapters, or all-linear.",
    )
    dtype: Literal["float32", "model"] = Field(
        "float32",
        description="The adapters' dtype: float32 = PEFT's default (every adapted projection's input and output "
        "cast to fp32 and back), model = the base's (bf16 on a TPU: the adapter branch in bf16, fp32 master "
        "copies of the adapters in the optimizer; the step's time and memory: docs/speed.md).",
    )
    use_rslora: bool = Field(False, description="Rank-stabilized LoRA (PEFT's use_rslora): scale = alpha / sqrt(r).")
    use_dora: bool = Field(
        False,
        description="DoRA (PEFT's use_dora): a learned magnitude per output on top of LoRA's direction; each "
        "adapted layer computes its weight's norm every step (see `lowmem-tpu memory RECIPE lora.use_dora=true "
        "--compile` for its cost). Not on a quantized base.",
    )
    init_lora_weights: bool | str = Field(
        True,
        description="PEFT's init_lora_weights: true (B = 0, A Kaiming), false, gaussian, or pissa / "
        "pissa_niter_N / olora (adapters from the base's principal directions, the base keeping the residual; "
        "the saved adapter is converted to apply to the original base). Not pissa/olora on a quantized base.",
    )
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        description="LoRA+: B's learning rate is train.learning_rate times this (the paper suggests 16); "
        "null = one learning rate.",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained in full and saved with the adapter (PEFT's modules_to_save), e.g. "
        "[embed_tokens, lm_head] when tokens are added.",
    )

    @field_validator("init_lora_weights", mode="before")
    @classmethod
    def _init(cls, value: Any) -> Any:
        if isinstance(value, bool) or value in ("gaussian", "pissa", "olora"):
            return value
        if isinstance(value, str) and value.startswith("pissa_niter_") and value[12:].isdigit():
            return value
        why = (
            " (PEFT 0.21's LoftQ computes on CUDA or XPU only, peft/utils/loftq_utils.py's compute_device: "
            "on a TPU VM, or a CPU, it stops with 'Found no NVIDIA driver')"
            if value == "loftq"
            else ""
        )
        raise ValueError(
            f"{value!r}{why}: choose true, false, gaussian, pissa, pissa_niter_N (N power iterations) or olora"
        )
