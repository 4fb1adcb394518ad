"""The recipe schema: one validated, frozen description of a fine-tuning run.

Sections (``model``, ``lora``, ``data``, ``sharding``, ``runtime``, ``train``, ``preference``, ``hub``) plus
top-level ``method``, ``output_dir`` and ``extends``. Every field has a description (they feed ``--help``,
``show`` and docs/recipes.md); unknown keys are errors. Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lowmem_tpu.config.assets import chat_template_names, check_source
from lowmem_tpu.config.checks import CROSS_FIELDS, cross_problems
from lowmem_tpu.config.devices import TARGETS
from lowmem_tpu.config.methods import METHOD_NAMES, METHODS, method_for_format
from lowmem_tpu.config.model_fields import LoraSection, ModelSection
from lowmem_tpu.config.preference_fields import PreferenceSection
from lowmem_tpu.config.rules import parse_duration
from lowmem_tpu.config.section import Section

# The fields each data format reads from a record (``data.columns`` maps them to other column names).
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "alpaca": ("instruction", "input", "output"),
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "sharegpt": ("conversations",),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}


class DataSection(Section):
    """Training (and held-out) data, its format, and the static shape it is tokenized to."""

    path: str = Field(
        "builtin:reverse/train.jsonl",
        description="Training data: local JSONL/JSON/CSV/Parquet file, Hub dataset, or builtin:NAME.",
    )
    split: str = Field("train", description="Split to read from a Hub dataset.")
    subset: str | None = Field(None, description="Configuration (subset) of a Hub dataset, e.g. 'en'.")
    eval_path: str | None = Field(None, description="Held-out data in the same format (file or Hub dataset).")
    eval_split: str | None = Field(None, description="Split of eval_path to evaluate on (default: split).")
    eval_fraction: float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="Without eval_path: hold out this fraction of the training records for evaluation "
        "(a fixed seed: the same records in every run); they are never trained on.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for format chat: plain or chatml (shipped), or a Jinja file "
        "(default: the tokenizer's own, else plain). Saved with the tokenizer in final/.",
    )
    format: Literal["text", "alpaca", "chat", "prompt_completion", "sharegpt", "preference", "unpaired"] = Field(
        "chat",
        description="text: a text column; alpaca: instruction/input/output; chat: messages of role/content; "
        "prompt_completion: TRL's prompt/completion (strings, or lists of messages); sharegpt: conversations "
        "of from/value turns; preference (method dpo, orpo, cpo, simpo): TRL's prompt/chosen/rejected (strings, "
        "or lists of messages; without prompt, chosen and rejected share it); unpaired (method kto): TRL's "
        "prompt/completion/label, the label true for a desirable completion.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="The format's fields read from other columns, {field: column}: e.g. databricks-dolly as "
        "alpaca: {instruction: instruction, input: context, output: response}.",
    )
    mask_prompt: bool = Field(
        True, description="Train only on the answers: completions, outputs, assistant turns (not for text)."
    )
    max_length: int = Field(
        512, gt=1, le=131072, description="Every batch is padded/packed to this length: activations scale with it."
    )
    packing: bool = Field(
        False,
        description="Several whole samples per max_length row (less padding compute); each sample attends "
        "only to itself (segment ids, positions restart), so the per-sample losses are the unpacked ones.",
    )
    max_samples: int | None = Field(None, gt=0, description="Use at most this many training samples.")
    too_long: Literal["truncate", "drop", "error"] = Field(
        "truncate",
        description="What to do with samples longer than max_length (preference pairs: truncate cuts the "
        "prompt from the left first).",
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return None if value is None else check_source(value, "dataset")

    @model_validator(mode="after")
    def _columns(self) -> DataSection:
        fields = FORMAT_FIELDS[self.format]
        unknown = sorted(set(self.columns) - set(fields))
        if unknown:
            raise ValueError(
                f"columns: {', '.join(unknown)} is not a field of format {self.format}; its fields are "
                f"{', '.join(fields)} (map each to the column that holds it)"
            )
        return self

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None or value in chat_template_names() or Path(value).expanduser().is_file():
            return value
        names = ", ".join(chat_template_names())
        raise ValueError(f"{value!r} is neither a shipped template ({names}) nor a Jinja file that exists")


class ShardingSection(Section):
    """How weights are split over the XLA devices (FSDPv2) and which layers are recomputed."""

    strategy: Literal["fsdp", "replicated"] = Field(
        "fsdp", description="fsdp: every weight sharded over all devices (1/N each); replicated: a copy per device."
    )
    activation_checkpointing: bool | str = Field(
        True,
        description="true: recompute every decoder layer in backward (keeps each layer's input only, one more "
        "forward of each layer); every_K (every_2, every_3, ...): recompute one layer in K, the others keep their "
        "activations (K times less recompute, more memory); false: recompute nothing.",
    )
    scan_layers: bool = Field(
        False,
        description="Compile one decoder layer and scan it over all layers (torch_xla scan_layers): "
        "the step compiles faster for a TPU; stacks the layer weights each step (one more sharded copy of "
        "them per chip: `lowmem-tpu memory RECIPE sharding.scan_layers=true --compile`; docs/tpu_compiler.md).",
    )
    layer_class: str | None = Field(
        None, description="Decoder layer class to wrap and checkpoint (default: the model's own decoder layer)."
    )

    @field_validator("activation_checkpointing")
    @classmethod
    def _policy(cls, value: bool | str) -> bool | str:
        if isinstance(value, bool) or checkpoint_interval(value) > 1:
            return value
        raise ValueError(f"{value!r}: use true, false, or every_K with K >= 2 (every_2: one layer in two)")

    @property
    def checkpoint_every(self) -> int:
        """Layers per checkpointed layer: 0 none, 1 every layer, K one layer in K."""
        value = self.activation_checkpointing
        return int(value) if isinstance(value, bool) else checkpoint_interval(value)


def checkpoint_interval(value: str) -> int:
    """K of an ``every_K`` checkpointing policy (0 when the text is not one)."""
    head, _, count = value.partition("_")
    return int(count) if head == "every" and count.isdigit() else 0


class RuntimeSection(Section):
    """The XLA devices: a TPU, or virtual devices on the CPU backend for a rehearsal."""

    device: Literal["auto", "tpu", "cpu"] = Field("auto", description="auto: the TPU if there is one, else the CPU.")
    target: Literal[TARGETS] | None = Field(  # type: ignore[valid-type]
        None,
        description="The TPU VM this recipe is sized for (v5e-1, v5e-8, v6e-8, v4-8, ..., or cpu): `memory`, "
        "`validate` and `compare` plan for it and a run on another TPU warns (null: the TPU found, else cpu).",
    )
    num_cpu_devices: int = Field(4, ge=1, le=64, description="Virtual XLA devices on the CPU backend.")
    compile_cache_dir: str | None = Field(
        "auto",
        description="Persistent XLA compilation cache, reused by the next identical run on a TPU "
        "(auto: ~/.cache/lowmem-tpu/xla-PLATFORM; null disables it).",
    )
    quiet: bool = Field(True, description="Hide the XLA/transformers warning wall on stderr.")


class TrainSection(Section):
    """Optimisation, batch shape, logging and evaluation."""

    max_steps: int = Field(100, gt=0, description="Optimizer steps to run.")
    global_batch_size: int = Field(
        8, gt=0, description="Samples per optimizer step, over all devices and accumulation steps."
    )
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-batches per step: divides activation memory, same global batch."
    )
    learning_rate: float = Field(2e-4, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warm-up steps (the first at the second's rate, never 0: it would train nothing)."
    )
    optimizer: Literal["adamw", "adafactor"] = Field(
        "adamw", description="adamw: 8 bytes/param of state; adafactor: factored, far less."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 disables).")
    logging_steps: int = Field(10, gt=0, description="Log loss, learning rate, tokens/s every N steps.")
    eval_steps: int | None = Field(None, gt=0, description="Evaluate the eval set every N steps (and at the end).")
    eval_samples: int = Field(
        0, ge=0, description="Held-out prompts scored by greedy exact match before and after training."
    )
    fused_lm_head: bool = Field(
        False,
        description="TRL's chunked LM head: never builds [batch, length, vocab] logits (saves ~8 bytes x that "
        "per device) at 1.3x-2x the step time on XLA: prefer train.chunked_loss.",
    )
    chunked_loss: bool = Field(
        False,
        description="Cross-entropy over blocks of at most 256 positions, recomputed in backward: never the whole "
        "[tokens, vocab] fp32 logits (saves ~12 bytes x tokens x vocab per device), ~1.1x the step time on the CPU.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="A MoE model's load-balancing loss, added to the logged and trained loss at this weight (TRL's "
        "field; default: the config's router_aux_loss_coef, high for gpt-oss; 0 turns it off).",
    )
    max_new_tokens: int = Field(16, gt=0, description="Generation length for the exact-match evaluation.")
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")
    save_steps: int | None = Field(
        None, gt=0, description="Write a resumable checkpoint every N steps (trainable state, optimizer, RNG, data)."
    )
    keep_last: int = Field(2, gt=0, description="Complete checkpoints kept; older ones go once a newer one is done.")
    resume: str = Field(
        "auto", description="auto: continue from the latest complete checkpoint in output_dir; never; or a path."
    )
    max_wall_time: str | None = Field(
        None, description="Save and stop cleanly before this much time has passed, e.g. 8h30m, 45m, 90s."
    )
    master_weights: bool | None = Field(
        None,
        description="fp32 copies of bf16 trainable weights for the optimizer (+4 bytes/param, sharded): "
        "updates below half a bf16 ULP would round to nothing (default: on when the trained weights are bf16: "
        "full fine-tuning of a bf16 model, or bf16 adapters, lora.dtype: model).",
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="NaN/Inf loss or gradients: stop the run at that logging step, or skip that update "
        "(skip checks every step: one host sync per step).",
    )
    loss_spike_factor: float = Field(
        5.0, ge=0, description="Warn when a logged loss exceeds this many times the running mean (0: never)."
    )
    report_to: list[Literal["tensorboard", "wandb"]] | Literal["none", "tensorboard", "wandb"] = Field(
        "none",
        description="Also send every log to tensorboard (output_dir/runs; pip install tensorboard) "
        "and/or wandb; output_dir/metrics.jsonl is always written.",
    )

    @property
    def reporters(self) -> list[str]:
        """``report_to`` as a list of integrations (empty for none)."""
        value = self.report_to
        return [] if value == "none" else [value] if isinstance(value, str) else list(dict.fromkeys(value))

    @field_validator("max_wall_time")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value


def reference_precomputed(recipe: Recipe) -> bool:
    """Whether a DPO run computes its reference's log-probabilities once, before training
    (``preference.precompute_ref_log_probs``; by default exactly for full-parameter DPO)."""
    if not METHODS[recipe.method].reference:
        return False
    chosen = recipe.preference.precompute_ref_log_probs
    return not recipe.lora.enabled if chosen is None else chosen


def uses_master_weights(recipe: Recipe) -> bool:
    """Whether the optimizer keeps fp32 master weights: ``train.master_weights``, else whenever the trained
    weights are bf16 (full fine-tuning of a bf16 model, or adapters in the base's bf16: ``lora.dtype: model``)."""
    if recipe.train.master_weights is not None:
        return recipe.train.master_weights
    return recipe.model.dtype == "bfloat16" and (not recipe.lora.enabled or recipe.lora.dtype == "model")


class HubSection(Section):
    """Pushing the result to the Hugging Face Hub."""

    push: bool = Field(False, description="Push the result to the Hugging Face Hub after training.")
    repo_id: str | None = Field(None, description="OWNER/NAME of the Hub repository.")
    private: bool = Field(False, description="Create the repository as private.")


class Recipe(Section):
    """A whole fine-tuning run: top-level keys plus one mapping per section."""

    extends: str | None = Field(
        None, description="Recipe file this one extends (relative to this file), else a shipped recipe by name."
    )
    method: Literal[METHOD_NAMES] = Field(  # type: ignore[valid-type]
        "sft",
        description="How to train: sft; dpo (against a frozen reference); orpo, cpo, simpo (no reference). "
        "Unset: dpo for data.format preference, else sft. `lowmem-tpu METHOD RECIPE` sets it.",
    )
    output_dir: str = Field("outputs/run", description="Where checkpoints and final/ are written.")
    model: ModelSection = Field(default_factory=ModelSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    sharding: ShardingSection = Field(default_factory=ShardingSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    train: TrainSection = Field(default_factory=TrainSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    hub: HubSection = Field(default_factory=HubSection)

    @model_validator(mode="before")
    @classmethod
    def _method_from_data(cls, data: object) -> object:
        # A recipe that names no method: the one its data asks for (preference pairs: DPO).
        if isinstance(data, dict) and data.get("method") is None:
            section = data.get("data") or {}
            fmt = section.get("format", "chat") if isinstance(section, dict) else section.format
            data = {**data, "method": method_for_format(fmt)}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        # Run by pydantic once every field is valid, so a recipe built directly is checked too;
        # config.validate reads the (fields, message) pairs from the error's context.
        problems = cross_problems(self)
        if problems:
            message = "\n".join(text for _, text in problems)
            raise PydanticCustomError(CROSS_FIELDS, "{message}", {"message": message, "problems": problems})
        return self

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (no ``extends``: every value is spelled out)."""
        data = self.model_dump(mode="json", exclude={"extends"})
        return yaml.safe_dump(data, sort_keys=False)
