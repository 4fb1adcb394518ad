"""The recipe: one validated, frozen description of a fine-tuning run.

A recipe is a YAML file (optionally extending another) plus dotted ``KEY=VALUE``
overrides. Loading it never imports torch: every problem is reported at once as
``dotted.path: message`` through :class:`RecipeError`.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lowmem_tpu.errors import UserError

BUILTIN = "builtin:"
ASSETS = Path(__file__).parent / "assets"
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class RecipeError(UserError):
    """A recipe that cannot be used; ``problems`` lists every ``dotted.path: message``."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def resolve_builtin(value: str) -> Path:
    """Path of a packaged asset named ``builtin:NAME``."""
    return ASSETS / value.removeprefix(BUILTIN)


def looks_local(value: str) -> bool:
    """True when a string is meant as a path on this machine rather than a Hub id."""
    return (
        value.startswith(("/", "./", "../", "~")) or value.endswith(DATA_SUFFIXES) or Path(value).expanduser().exists()
    )


def _check_source(value: str, what: str) -> str:
    if value.startswith(BUILTIN):
        if not resolve_builtin(value).exists():
            known = sorted(p.name for p in ASSETS.iterdir() if not p.name.startswith("_"))
            raise ValueError(f"no built-in {what} {value!r}; built-in ones: {', '.join(known)}")
    elif looks_local(value) and not Path(value).expanduser().exists():
        raise ValueError(f"file or directory not found: {value} (give an existing path or a Hub id)")
    return value


class ModelSection(Section):
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
    tokenizer: str | None = Field(None, description="Tokenizer path or Hub id; defaults to name_or_path.")
    use_fast_tokenizer: bool = Field(True, description="Fast (Rust) tokenizer; Open Llama asks for the slow one.")
    pad_token: str | None = Field(
        None,
        description="Pad token to use when the tokenizer has none (default: unk, else eos; "
        "padding is masked by position, so eos is still learned).",
    )
    attn_implementation: Literal["eager", "sdpa"] = Field(
        "eager", description="Attention kernel; eager is the XLA-friendly default."
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _no_fp16(cls, value: Any) -> Any:
        if str(value).lower() in {"float16", "fp16", "half", "torch.float16"}:
            raise ValueError("fp16 is not a TPU training dtype: TPUs train in bfloat16 (use model.dtype: bfloat16)")
        return value

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return None if value is None else _check_source(value, "model")


class LoraSection(Section):
    enabled: bool = Field(True, description="Train LoRA adapters on a frozen base; false = full fine-tuning.")
    r: int = Field(16, gt=0, le=4096, description="LoRA rank: adapter memory grows linearly with r.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get adapters, or all-linear.",
    )


class DataSection(Section):
    path: str = Field("builtin:reverse/train.jsonl", description="Local JSONL/JSON/CSV/Parquet file or Hub dataset.")
    split: str = Field("train", description="Split to read from a Hub dataset.")
    eval_path: str | None = Field(None, description="Held-out data in the same format (file or Hub dataset).")
    eval_split: str | None = Field(None, description="Split of a Hub dataset to evaluate on.")
    format: Literal["text", "alpaca", "chat"] = Field(
        "chat", description="text: a text field; alpaca: instruction/input/output; chat: messages."
    )
    text_field: str = Field("text", description="Column with the text (format text).")
    messages_field: str = Field("messages", description="Column with the conversation (format chat).")
    mask_prompt: bool = Field(True, description="Train only on completions (alpaca) or assistant turns (chat).")
    max_length: int = Field(
        512, gt=1, le=131072, description="Every batch is padded/packed to this length: activations scale with it."
    )
    packing: bool = Field(False, description="Concatenate samples into full max_length rows (no padding waste).")
    max_samples: int | None = Field(None, gt=0, description="Use at most this many training samples.")
    too_long: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="What to do with samples longer than max_length."
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return None if value is None else _check_source(value, "dataset")


class ShardingSection(Section):
    strategy: Literal["fsdp", "replicated"] = Field(
        "fsdp", description="fsdp: every weight sharded over all devices (1/N each); replicated: a copy per device."
    )
    activation_checkpointing: bool = Field(
        True, description="Recompute each decoder layer in backward: keeps one layer's activations, ~+30% compute."
    )
    layer_class: str | None = Field(
        None, description="Decoder layer class to wrap and checkpoint (default: the model's own decoder layer)."
    )


class RuntimeSection(Section):
    device: Literal["auto", "tpu", "cpu"] = Field("auto", description="auto: the TPU if there is one, else the CPU.")
    num_cpu_devices: int = Field(4, ge=1, le=64, description="Virtual XLA devices on the CPU backend.")
    compile_cache_dir: str | None = Field(
        None, description="Persistent XLA compilation cache (reused on TPU); none to disable."
    )
    quiet: bool = Field(True, description="Hide the XLA/transformers warning wall on stderr.")


class TrainSection(Section):
    max_steps: int = Field(100, gt=0, description="Optimizer steps to run.")
    global_batch_size: int = Field(
        8, gt=0, description="Samples per optimizer step, over all devices and accumulation steps."
    )
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-batches per step: divides activation memory, same global batch."
    )
    learning_rate: float = Field(2e-4, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
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
    max_new_tokens: int = Field(16, gt=0, description="Generation length for the exact-match evaluation.")
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")


class HubSection(Section):
    push: bool = Field(False, description="Push the result to the Hugging Face Hub after training.")
    repo_id: str | None = Field(None, description="OWNER/NAME of the Hub repository.")
    private: bool = Field(False, description="Create the repository as private.")


class Recipe(Section):
    extends: str | None = Field(None, description="Recipe file this one extends (relative to this file).")
    output_dir: str = Field("outputs/run", description="Where checkpoints and final/ are written.")
    model: ModelSection = Field(default_factory=ModelSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    sharding: ShardingSection = Field(default_factory=ShardingSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    train: TrainSection = Field(default_factory=TrainSection)
    hub: HubSection = Field(default_factory=HubSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        problems = []
        t = self.train
        if t.global_batch_size % t.gradient_accumulation_steps:
            problems.append(
                f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps})"
            )
        if self.runtime.device == "cpu" or (self.runtime.device == "auto" and not tpu_present()):
            devices = self.runtime.num_cpu_devices
            micro = t.global_batch_size // t.gradient_accumulation_steps
            if micro % devices:
                problems.append(
                    f"train.global_batch_size: the micro-batch ({t.global_batch_size} / "
                    f"{t.gradient_accumulation_steps} accumulation steps = {micro}) must split evenly over "
                    f"{devices} devices; use a multiple of {devices * t.gradient_accumulation_steps}"
                )
        if self.hub.push and not self.hub.repo_id:
            problems.append("hub.repo_id: required when hub.push is true (OWNER/NAME)")
        if t.eval_samples and not self.data.eval_path:
            problems.append("train.eval_samples: needs data.eval_path (held-out prompts to score)")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (no ``extends``: every value is spelled out)."""
        data = self.model_dump(mode="json", exclude={"extends"})
        return yaml.safe_dump(data, sort_keys=False)


def tpu_present() -> bool:
    """Cheap TPU detection that imports nothing heavy."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return False
    return (
        os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
        or any(Path("/dev").glob("accel*"))
        or any(Path("/dev/vfio").glob("[0-9]*"))
    )


def _read_yaml(path: Path, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecipeError([f"{where}: recipe file not found: {path}"]) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"{where}: not valid YAML in {path}: {err}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{where}: {path} must hold a mapping of sections, not {type(data).__name__}"])
    return data


def _deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_recipe_file(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file with its ``extends`` chain merged in (the child wins)."""
    path = Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise RecipeError([f"extends: cycle: {cycle}"])
    data = _read_yaml(path, "extends" if _chain else "recipe")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError([f"extends: must be a file name, not {parent!r}"])
    return _deep_merge(read_recipe_file(path.parent / parent, (*_chain, resolved)), data)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides; values are parsed as YAML scalars."""
    data = _deep_merge({}, data)
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"{item}: an override is section.key=value, e.g. train.max_steps=50")
            continue
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
    if problems:
        raise RecipeError(problems)
    return data


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(error: dict[str, Any]) -> list[str]:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc) or "recipe"
    if error["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""
        return [f"{path}: unknown key{hint} (valid: {', '.join(valid)})"]
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "value_error" and not loc:
        return message.splitlines()
    return [f"{path}: {message}"]


def validate_recipe(data: dict[str, Any]) -> Recipe:
    """Validate a merged recipe mapping; raise :class:`RecipeError` listing every problem."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        problems = [line for error in err.errors() for line in _describe(error)]
        raise RecipeError(problems) from None


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load, merge, override and validate a recipe (the embedded default when ``path`` is None)."""
    data = read_recipe_file(path or default_recipe_path())
    return validate_recipe(apply_overrides(data, overrides or []))


def default_recipe_path() -> Path:
    """The embedded default: a tiny Llama learning a string task on CPU devices."""
    return Path(__file__).parent / "recipes" / "tiny_lora_cpu.yaml"
