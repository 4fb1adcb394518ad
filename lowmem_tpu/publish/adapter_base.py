"""The base an adapter goes onto: the adapter's files and recorded base, the run's recipe, and the base
model built on the CPU as the run built it (quantized as it trained, for a QLoRA run)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lowmem_tpu.errors import UserError
from lowmem_tpu.files import check_whole, checkpoint_instead
from lowmem_tpu.publish.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

LORA_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class BaseChoice:
    """The base model the adapter is merged into, and whether it is the one the adapter records."""

    source: str
    revision: str | None
    recorded: str
    recorded_revision: str | None
    forced: bool


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The adapter's config, after checking that the directory holds a LoRA adapter."""
    if not adapter_dir.is_dir():
        raise UserError(f"{adapter_dir}: no such directory; give output_dir/final of a LoRA run")
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter_dir / name).is_file()]
    if missing and (err := checkpoint_instead(adapter_dir)):
        raise err
    check_whole(adapter_dir)
    if missing and (adapter_dir / "config.json").is_file() and not (adapter_dir / ADAPTER_CONFIG).exists():
        raise UserError(
            f"{adapter_dir} holds a full model, not a LoRA adapter: there is nothing to merge "
            "(push or load it as it is)"
        )
    if missing:
        raise UserError(
            f"{adapter_dir} is not a complete LoRA adapter: missing {', '.join(missing)}; "
            "give output_dir/final of a LoRA run (lora.enabled: true)"
        )
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG}: not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA" or not config.get("base_model_name_or_path"):
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG}: not a LoRA adapter config naming its base model")
    return config


def read_recipe_data(directory: Path) -> dict[str, Any]:
    """The resolved ``recipe.yaml`` of a run as plain data ({} if absent).

    Not validated: a recipe written on a TPU VM names files that need not exist here.
    """
    path = directory / "recipe.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def _same_source(a: str, b: str) -> bool:
    from lowmem_tpu.model import resolve_source

    pa, pb = Path(resolve_source(a)).expanduser(), Path(resolve_source(b)).expanduser()
    if pa.exists() or pb.exists():
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def choose_base(
    config: dict[str, Any], adapter_dir: Path, base: str | None, revision: str | None, force: bool
) -> BaseChoice:
    """The base to merge into: the recorded one, or ``base``/``revision`` (refused when they differ, unless forced)."""
    recorded = config["base_model_name_or_path"]
    recorded_revision = config.get("revision") or read_recipe_data(adapter_dir).get("model", {}).get("revision")
    source = base or recorded
    chosen_revision = revision or (recorded_revision if base is None or _same_source(base, recorded) else None)
    problems = []
    if not _same_source(source, recorded):
        problems.append(f"--base {source} is not the base the adapter was trained on ({recorded})")
    if (chosen_revision or "main") != (recorded_revision or "main"):
        problems.append(
            f"--revision {chosen_revision or 'main'} is not the revision the adapter was trained on "
            f"({recorded_revision or 'main'})"
        )
    if problems and not force:
        raise UserError(
            [*problems, "pass --force if you are sure it is the same model (for example a moved copy)"]
            if len(problems) > 1
            else f"{problems[0]}; pass --force if you are sure it is the same model (for example a moved copy)"
        )
    if base is None and looks_missing_path(recorded):
        raise UserError(
            f"the adapter's base {recorded} does not exist on this machine; "
            "pass --base PATH_OR_ID (with --force, since it differs from the recorded one)"
        )
    return BaseChoice(source, chosen_revision, recorded, recorded_revision, bool(problems))


def looks_missing_path(source: str) -> bool:
    from lowmem_tpu.config.assets import looks_local

    return looks_local(source) and not Path(source).expanduser().exists()


def check_adapter_tensors(adapter_dir: Path, base_config: Any) -> None:
    """Every LoRA tensor is finite and fits its base module; problems name the module and both shapes.

    Runs on a ``meta`` model (no weights), so a wrong base is refused before gigabytes are loaded.
    """
    import torch
    from safetensors.torch import load_file

    from lowmem_tpu.model import meta_model

    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    bad = [key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise UserError(
            f"{adapter_dir / ADAPTER_WEIGHTS}: {len(bad)} tensor(s) hold NaN or Inf (first: {bad[0]}); "
            "the adapter is broken (retrain, e.g. with a lower train.learning_rate)"
        )
    model = meta_model(base_config)
    stacked = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("target_parameters") or []
    problems = []
    for name in sorted({_module_name(key) for key in tensors if key.endswith(LORA_SUFFIXES)}):
        a, b = tensors.get(f"{LORA_PREFIX}{name}.lora_A.weight"), tensors.get(f"{LORA_PREFIX}{name}.lora_B.weight")
        label, shape = adapted_weight(model, name, stacked)
        if shape is None:
            problems.append(f"{name}: the adapter has LoRA weights for it, the base has no such layer")
        elif a is not None and b is not None and (b.shape[0], a.shape[1]) != shape[-2:]:
            problems.append(
                f"{label}: the adapter expects a base weight of shape {(b.shape[0], a.shape[1])} "
                f"(lora_B {tuple(b.shape)} x lora_A {tuple(a.shape)}), the base has {shape}"
            )
        elif a is not None and len(shape) == 3 and a.shape[0] % shape[0]:
            problems.append(f"{label}: lora_A {tuple(a.shape)} is not a rank per each of its {shape[0]} experts")
    if problems:
        more = [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
        raise UserError(
            ["the base does not match the adapter (was it trained on another model?):", *problems[:10], *more]
        )


def adapted_weight(model: Any, name: str, stacked: list[str]) -> tuple[str, tuple[int, ...] | None]:
    """The base weight an adapter module's LoRA applies to, and its shape as PEFT orients it (None: no such
    weight). PEFT wraps a module's stacked experts (``target_parameters``) one inside the other in the module's
    parameter order, so ``experts``, ``experts.base_layer``, ... name them from the last to the first."""
    modules = dict(model.named_modules())
    depth = 0
    while name.endswith(".base_layer"):
        name, depth = name.removesuffix(".base_layer"), depth + 1
    module = modules.get(name)
    if module is None:
        return name, None
    leaves = [
        leaf
        for leaf, _ in module.named_parameters(recurse=False)
        if any(f"{name}.{leaf}".endswith(f".{target}") or target == leaf for target in stacked)
    ]
    if not leaves:
        return name, (tuple(module.weight.shape) if depth == 0 and hasattr(module, "weight") else None)
    if depth >= len(leaves):
        return name, None
    leaf = leaves[len(leaves) - 1 - depth]
    shape = tuple(getattr(module, leaf).shape)
    if len(shape) == 3 and not getattr(module, "is_transposed", False):
        return f"{name}.{leaf}", shape  # PEFT's lora_B x lora_A is [out, in] = the stack's last two dims
    return f"{name}.{leaf}", (*shape[:-2], shape[-1], shape[-2]) if len(shape) == 3 else shape


def _module_name(key: str) -> str:
    key = key.removeprefix(LORA_PREFIX)
    for suffix in LORA_SUFFIXES:
        key = key.removesuffix(suffix)
    return key


def load_base_config(choice: BaseChoice) -> Any:
    from transformers import AutoConfig

    from lowmem_tpu.model import resolve_source

    try:
        return AutoConfig.from_pretrained(resolve_source(choice.source), revision=choice.revision)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the config of the base {choice.source!r}: {err}") from None


QUANTIZED_FIELDS = ("quantize", "quantize_group_size", "quantize_double", "quantize_lm_head", "dtype")


def trained_quantization(adapter_dir: Path) -> dict[str, Any] | None:
    """The run's quantized-base fields (with the dtype it trained in), or None for a full-precision base."""
    model = read_recipe_data(adapter_dir).get("model", {})
    if model.get("quantize", "none") in ("none", None, False):
        return None
    return {key: model[key] for key in QUANTIZED_FIELDS if model.get(key) is not None}


def load_causal_lm(source: str, revision: str | None, dtype: str | None, quantized: dict | None = None) -> Any:
    """The model at ``source`` on the CPU, built as training builds its base (``dtype`` None: its own;
    ``quantized``: the run's quantization fields, which build the base quantized as it trained)."""
    from safetensors import SafetensorError

    from lowmem_tpu.config import ModelSection, with_fields
    from lowmem_tpu.model import build_base_model, load_config

    try:
        fields = {"dtype": dtype or "float32", **(quantized or {})}
        section = ModelSection(name_or_path=source, revision=revision, **fields)
        if dtype is None and quantized is None:
            own = getattr(load_config(section), "dtype", None)
            section = with_fields(section, dtype="float32" if str(own).endswith("float32") else "bfloat16")
        model = build_base_model(section)
    except UserError as err:
        raise UserError(f"cannot load the model {source!r}: {err}") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise UserError(f"cannot load the model {source!r}: {type(err).__name__}: {err}") from None
    return model.eval()


def adapter_tokenizer(adapter_dir: Path, choice: BaseChoice) -> Any:
    """The tokenizer saved with the adapter (its chat template included), else the base's."""
    from lowmem_tpu.config import ModelSection
    from lowmem_tpu.model import load_tokenizer

    model = read_recipe_data(adapter_dir).get("model", {})
    own = (adapter_dir / "tokenizer_config.json").is_file()
    section = ModelSection(
        name_or_path=choice.source,
        revision=None if own else choice.revision,
        tokenizer=str(adapter_dir) if own else None,
        use_fast_tokenizer=model.get("use_fast_tokenizer", True),
        pad_token=model.get("pad_token"),
    )
    return load_tokenizer(section)
