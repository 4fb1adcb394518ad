"""The recipe: one validated, frozen description of a fine-tuning run.

A recipe is a YAML file (optionally extending another) plus dotted ``KEY=VALUE``
overrides. Loading it never imports torch: every problem is reported at once as
``dotted.path: message`` through :class:`RecipeError`.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lowmem_tpu.errors import UserError

BUILTIN = "builtin:"
ASSETS = Path(__file__).parent / "assets"
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class RecipeError(UserError):
    """A recipe that cannot be used; ``problems`` lists every ``dotted.path: message``."""


class Section(BaseModel):
    """A recipe section: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def resolve_builtin(value: str) -> Path:
    """Path of a packaged asset named ``builtin:NAME``."""
    return ASSETS / value.removeprefix(BUILTIN)


def looks_local(value: str) -> bool:
    """True when a string is meant as a path on this machine rather than a Hub id."""
    return (
        value.startswith(("/", "./", "../", "~")) or value.endswith(DATA_SUFFIXES) or Path(value).expanduser().exists()
    )


def _visible(path: Path) -> bool:
    return not any(part.startswith(("_", ".")) for part in path.relative_to(ASSETS).parts)


def builtin_names(kind: Literal["model", "dataset"]) -> list[str]:
    """The usable ``builtin:`` names: model directories (holding a config.json) or data files."""
    if not ASSETS.is_dir():
        return []
    models = sorted(p.parent for p in ASSETS.rglob("config.json") if _visible(p))
    if kind == "model":
        return [p.relative_to(ASSETS).as_posix() for p in models]
    files = (
        p
        for p in ASSETS.rglob("*")
        if p.is_file() and p.suffix in DATA_SUFFIXES and _visible(p) and not any(m in p.parents for m in models)
    )
    return sorted(p.relative_to(ASSETS).as_posix() for p in files)


def builtin_has_weights(value: str) -> bool:
    """True when a ``builtin:`` model directory ships weights (the bundled ones ship only a config)."""
    path = resolve_builtin(value)
    return path.is_dir() and any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir())


def _check_source(value: str, what: Literal["model", "dataset"]) -> str:
    if value.startswith(BUILTIN):
        known = builtin_names(what)
        if value.removeprefix(BUILTIN) not in known:
            kind = "files" if what == "dataset" else "directories"
            names = ", ".join(BUILTIN + name for name in known) or "none"
            raise ValueError(f"no built-in {what} {value!r}; built-in ones ({kind}): {names}")
    elif looks_local(value):
        path = Path(value).expanduser()
        if not path.exists():
            raise ValueError(f"file or directory not found: {value} (give an existing path or a Hub id)")
        if what == "model" and not path.is_dir():
            raise ValueError(f"{value} is a file; give the directory that holds the model's config.json")
    return value


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
    quantize: Literal["none", "int8", "int4"] = Field(
        "none",
        description="Freeze the base's decoder linears in int8 (one scale per output row) or int4 "
        "(one scale per group of inputs, two per byte), quantized while loading; LoRA only (QLoRA).",
    )
    quantize_group_size: Literal[32, 64, 128, 256] = Field(
        64, description="int4: inputs sharing one scale (smaller = more accurate, more scales)."
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

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return None if value is None else _check_source(value, "model")


class LoraSection(Section):
    """LoRA adapters (PEFT); disable for full-parameter fine-tuning."""

    enabled: bool = Field(True, description="Train LoRA adapters on a frozen base; false = full fine-tuning.")
    r: int = Field(16, gt=0, le=4096, description="LoRA rank: adapter memory grows linearly with r.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get adapters, or all-linear.",
    )


class DataSection(Section):
    """Training (and held-out) data, its format, and the static shape it is tokenized to."""

    path: str = Field(
        "builtin:reverse/train.jsonl",
        description="Training data: local JSONL/JSON/CSV/Parquet file, Hub dataset, or builtin:NAME.",
    )
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
    """How weights are split over the XLA devices (FSDPv2) and which layers are recomputed."""

    strategy: Literal["fsdp", "replicated"] = Field(
        "fsdp", description="fsdp: every weight sharded over all devices (1/N each); replicated: a copy per device."
    )
    activation_checkpointing: bool = Field(
        True, description="Recompute each decoder layer in backward: keeps one layer's activations, ~+30% compute."
    )
    scan_layers: bool = Field(
        False,
        description="Compile one decoder layer and scan it over all layers (torch_xla scan_layers): "
        "less compile time for deep models; stacks the layer weights (+1 copy of the layer weights, sharded).",
    )
    layer_class: str | None = Field(
        None, description="Decoder layer class to wrap and checkpoint (default: the model's own decoder layer)."
    )


class RuntimeSection(Section):
    """The XLA devices: a TPU, or virtual devices on the CPU backend for a rehearsal."""

    device: Literal["auto", "tpu", "cpu"] = Field("auto", description="auto: the TPU if there is one, else the CPU.")
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
    fused_lm_head: bool = Field(
        False,
        description="TRL's chunked LM head: never builds [batch, length, vocab] logits (saves ~8 bytes x that "
        "per device) but about doubles step time on XLA.",
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
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="NaN/Inf loss or gradients: stop the run at that logging step, or skip that update "
        "(skip checks every step: one host sync per step).",
    )
    loss_spike_factor: float = Field(
        5.0, ge=0, description="Warn when a logged loss exceeds this many times the running mean (0: never)."
    )

    @field_validator("max_wall_time")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value


class HubSection(Section):
    """Pushing the result to the Hugging Face Hub."""

    push: bool = Field(False, description="Push the result to the Hugging Face Hub after training.")
    repo_id: str | None = Field(None, description="OWNER/NAME of the Hub repository.")
    private: bool = Field(False, description="Create the repository as private.")


class Recipe(Section):
    """A whole fine-tuning run: top-level keys plus one mapping per section."""

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
    def _cross_checks(self, info: ValidationInfo) -> Recipe:
        # validate_recipe defers these so it can drop the ones a bad field would make spurious.
        if not (info.context or {}).get(_DEFER_CROSS_CHECKS):
            problems = [message for _, message in cross_problems(self)]
            if problems:
                raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (no ``extends``: every value is spelled out)."""
        data = self.model_dump(mode="json", exclude={"extends"})
        return yaml.safe_dump(data, sort_keys=False)


_DEFER_CROSS_CHECKS = "lowmem_tpu.defer_cross_checks"


def cross_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """Problems that involve several fields, each as (the dotted fields involved, message)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    t, model, data = recipe.train, recipe.model, recipe.data
    batch = ("train.global_batch_size", "train.gradient_accumulation_steps")
    if t.global_batch_size % t.gradient_accumulation_steps:
        message = f"{t.global_batch_size} is not divisible by train.gradient_accumulation_steps"
        problems.append((batch, f"train.global_batch_size: {message} ({t.gradient_accumulation_steps})"))
    # On a TPU the device count is only known once torch_xla starts; the runtime checks it there.
    if recipe.runtime.device == "cpu" or (recipe.runtime.device == "auto" and not tpu_present()):
        devices, accumulation = recipe.runtime.num_cpu_devices, t.gradient_accumulation_steps
        micro = t.global_batch_size // accumulation
        if micro % devices:
            message = (
                f"the micro-batch ({t.global_batch_size} / {accumulation} accumulation steps = {micro}) must "
                f"split evenly over {devices} devices; use a multiple of {devices * accumulation}"
            )
            fields = (*batch, "runtime.num_cpu_devices", "runtime.device")
            problems.append((fields, f"train.global_batch_size: {message}"))
    if model.name_or_path.startswith(BUILTIN) and not model.random_init and not builtin_has_weights(model.name_or_path):
        message = f"must be true for {model.name_or_path}, which ships a config and tokenizer but no weights"
        if "name_or_path" not in model.model_fields_set:
            message += " (it is the default model: set model.name_or_path to a Hub id or directory to use another)"
        problems.append((("model.name_or_path", "model.random_init"), f"model.random_init: {message}"))
    if model.quantize != "none" and not recipe.lora.enabled:
        message = (
            f"model.quantize: {model.quantize} freezes the base in {model.quantize}, but lora.enabled is false "
            "(full fine-tuning trains every base weight, which needs them in full precision); "
            "set lora.enabled: true to train LoRA adapters on the quantized base (QLoRA), or model.quantize: none"
        )
        problems.append((("model.quantize", "lora.enabled"), message))
    if model.quantize != "none" and recipe.sharding.scan_layers:
        message = (
            f"model.quantize: a {model.quantize} base is not supported with sharding.scan_layers yet "
            "(the scanned layer is traced functionally, the quantized projections are not); "
            "set sharding.scan_layers: false or model.quantize: none"
        )
        problems.append((("model.quantize", "sharding.scan_layers"), message))
    if recipe.hub.push and not recipe.hub.repo_id:
        problems.append((("hub.push", "hub.repo_id"), "hub.repo_id: required when hub.push is true (OWNER/NAME)"))
    if t.eval_samples and not data.eval_path:
        message = "train.eval_samples: needs data.eval_path (held-out prompts to score)"
        problems.append((("train.eval_samples", "data.eval_path"), message))
    if t.eval_steps and not data.eval_path:
        message = "train.eval_steps: needs data.eval_path (without it nothing would be evaluated)"
        problems.append((("train.eval_steps", "data.eval_path"), message))
    return problems


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``8h30m``, ``45m``, ``90s`` or ``1h``."""
    import re

    match = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", str(text))
    if not match or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration like 8h30m, 45m or 90s")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600.0 + minutes * 60.0 + seconds


def tpu_present() -> bool:
    """Cheap TPU detection that imports nothing heavy."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return False
    return (
        os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
        or any(Path("/dev").glob("accel*"))
        or any(Path("/dev/vfio").glob("[0-9]*"))
    )


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus YAML 1.2 floats without a dot (``3e-4``, ``1e5``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _read_yaml(path: Path, where: str, named_in: Path | None = None) -> dict[str, Any]:
    try:
        data = _parse_yaml(path.read_text())
    except FileNotFoundError:
        by = f" (named by {_show(named_in)})" if named_in else ""
        raise RecipeError([f"{where}: recipe file not found: {_show(path)}{by}"]) from None
    except IsADirectoryError:
        raise RecipeError([f"{where}: {_show(path)} is a directory, not a recipe file"]) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"{where}: not valid YAML in {_show(path)}: {err}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{where}: {_show(path)} must hold a mapping of sections, not {type(data).__name__}"])
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
    """A recipe file with its ``extends`` chain merged in (the child wins, mappings merge key by key).

    ``extends`` names a file relative to the recipe that names it.
    """
    path = Path(path).expanduser()
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(_show(p) for p in (*_chain, resolved))
        raise RecipeError([f"extends: cycle: {cycle} (a recipe cannot extend itself, even indirectly)"])
    data = _read_yaml(path, "extends" if _chain else "recipe", _chain[-1] if _chain else None)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise RecipeError([f"extends: must be a recipe file name, not {parent!r} (in {_show(path)})"])
    return _deep_merge(read_recipe_file(path.parent / Path(parent).expanduser(), (*_chain, resolved)), data)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides; values are parsed as YAML scalars (``[a, b]`` is a list)."""
    data = copy.deepcopy(data)  # the caller's mapping stays as it was
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"{item}: an override is section.key=value, e.g. train.max_steps=50")
            continue
        try:
            value = _parse_yaml(raw) if raw.strip() else None
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


# ----------------------------------------------------------------------------- validation


def _section_fields(keys: tuple[str, ...]) -> list[str]:
    """Field names of the section at ``keys`` (``()`` is the top level); [] when not a section."""
    model: type[BaseModel] = Recipe
    for key in keys:
        annotation = getattr(model.model_fields.get(key), "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _sections() -> list[str]:
    return [name for name in Recipe.model_fields if _section_fields((name,))]


def _split_loc(loc: tuple[Any, ...]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """Split an error location into recipe keys (down to the leaf field) and what lies inside the value."""
    keys: list[str] = []
    for i, part in enumerate(loc):
        section = _section_fields(tuple(keys))
        keys.append(str(part))
        if str(part) not in section or not _section_fields(tuple(keys)):
            return tuple(keys), tuple(loc[i + 1 :])
    return tuple(keys), ()


def _suggest(keys: tuple[str, ...]) -> str:
    """``did you mean``: the same key in another section, else a close key in the same section."""
    *parent, key = keys
    places = [(), *((section,) for section in _sections())]
    elsewhere = [(*place, key) for place in places if place != tuple(parent) and key in _section_fields(place)]
    if elsewhere:
        return ".".join(elsewhere[0])
    close = difflib.get_close_matches(key, _section_fields(tuple(parent)), n=1, cutoff=0.6)
    return ".".join([*parent, close[0]]) if close else ""


def _got(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return ""
    text = repr(value)
    return f" (got {text if len(text) <= 60 else text[:57] + '...'})"


def _message(error: dict[str, Any]) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    return message if error["type"] == "value_error" else message + _got(error.get("input"))


def _describe(keys: tuple[str, ...], errors: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[str]:
    """``dotted.path: message`` lines for the errors of one recipe key."""
    path = ".".join(keys)
    first = errors[0][1]
    if first["type"] == "extra_forbidden":
        suggestion = _suggest(keys)
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        valid = _section_fields(keys[:-1])
        return [f"{path}: unknown key{hint} (valid: {', '.join(valid)})"]
    if first["type"] in {"model_type", "dict_type"} and len(errors) == 1:
        valid = ", ".join(_section_fields(keys))
        return [f"{path}: must be a mapping of {keys[-1]} keys ({valid}){_got(first.get('input'))}"]
    # A union (e.g. a list of names or "all-linear") reports one error per alternative, tagged by
    # name in the location. Keep the alternative that got furthest; if none did, join them.
    branches = [(rest, e) for rest, e in errors if any(isinstance(part, str) for part in rest)]
    plain = [(rest, e) for rest, e in errors if not any(isinstance(part, str) for part in rest)]
    lines = [f"{path}{''.join(f'[{p}]' for p in rest)}: {_message(e)}" for rest, e in plain]
    if branches:
        depth = max(len(rest) for rest, _ in branches)
        deepest = [(rest, e) for rest, e in branches if len(rest) == depth]
        if depth > 1:
            lines += [
                f"{path}{''.join(f'[{p}]' for p in rest if isinstance(p, int))}: {_message(e)}" for rest, e in deepest
            ]
        else:
            messages = [str(e["msg"]) for _, e in deepest]
            joined = " or ".join([messages[0], *(m.removeprefix("Input should be ") for m in messages[1:])])
            lines.append(f"{path}: {joined}{_got(deepest[0][1].get('input'))}")
    return lines


def _without(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``data`` without the key at ``keys`` (so its default is used instead)."""
    if not keys or not isinstance(data, dict) or keys[0] not in data:
        return data
    data = dict(data)
    if len(keys) == 1:
        del data[keys[0]]
    else:
        data[keys[0]] = _without(data[keys[0]], keys[1:])
    return data


def _involves(fields: tuple[str, ...], removed: list[tuple[str, ...]]) -> bool:
    dotted = [".".join(keys) for keys in removed]
    return any(f == r or f.startswith(r + ".") or r.startswith(f + ".") for f in fields for r in dotted)


def validate_recipe(data: dict[str, Any]) -> Recipe:
    """Validate a merged recipe mapping; raise :class:`RecipeError` listing every problem.

    Field problems come first. The offending keys are then dropped (their defaults stand in)
    and the recipe validated again, so cross-field problems are reported in the same error,
    except those that involve a dropped key (they could be artefacts of the default).
    """
    problems: list[str] = []
    removed: list[tuple[str, ...]] = []
    recipe = None
    for _ in range(4):  # a second pass normally succeeds; the bound guards against surprises
        try:
            recipe = Recipe.model_validate(data, context={_DEFER_CROSS_CHECKS: True})
            break
        except ValidationError as err:
            grouped: dict[tuple[str, ...], list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
            for error in err.errors():
                keys, rest = _split_loc(tuple(error["loc"]))
                if keys:
                    grouped.setdefault(keys, []).append((rest, error))
                else:
                    problems.extend(_message(error).splitlines())
            if not grouped:
                break
            for keys, errors in grouped.items():
                problems.extend(_describe(keys, errors))
                removed.append(keys)
                data = _without(data, keys)
    if recipe is not None:
        problems.extend(message for fields, message in cross_problems(recipe) if not _involves(fields, removed))
    if problems or recipe is None:
        raise RecipeError(list(dict.fromkeys(problems)) or ["recipe: invalid"])
    return recipe


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load, merge, override and validate a recipe (the embedded default when ``path`` is None)."""
    data = read_recipe_file(path or default_recipe_path())
    return validate_recipe(apply_overrides(data, overrides or []))


def default_recipe_path() -> Path:
    """The embedded default: a tiny Llama learning a string task on CPU devices."""
    return Path(__file__).parent / "recipes" / "tiny_lora_cpu.yaml"
