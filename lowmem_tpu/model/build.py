"""The base model: its config (local, shipped or Hub) and its weights, built by one function.

``build_base_model`` makes the module tree on the ``meta`` device and fills it from the
checkpoint one tensor at a time, quantizing each decoder linear as it is read when
``model.quantize`` asks, so the full-precision model never exists in host memory as a whole.
Training, the memory measurement and ``merge`` all build their base here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from lowmem_tpu.config import ModelSection, Recipe, with_fields
from lowmem_tpu.config.assets import BUILTIN, resolve_builtin
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.mxfp4 import dequantized, readable_config
from lowmem_tpu.model.stacks import ExpertStacks, Slot, expert_slot

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIGS = Path(__file__).parent.parent / "model_configs"
Weights = Literal["checkpoint", "random", "meta"]


def resolve_source(name_or_path: str) -> str:
    """A ``builtin:`` name becomes its packaged directory; anything else is returned as is."""
    return str(resolve_builtin(name_or_path)) if name_or_path.startswith(BUILTIN) else name_or_path


def shipped_config_path(name_or_path: str) -> Path | None:
    """A config this project ships for a known Hub model (so nothing has to be downloaded)."""
    path = CONFIGS / (name_or_path.replace("/", "__") + ".json")
    return path if path.exists() else None


def load_config(cfg: ModelSection, offline: bool = False) -> Any:
    """The model's config: local or built-in directory, shipped copy, or the Hub, as the loader builds it
    (``mxfp4.readable_config``: a checkpoint's MXFP4 quantization dropped, another quantization refused).

    With ``offline`` only local files are read and ``None`` is returned when none exist.
    """
    config = _stored_config(cfg, offline)
    return None if config is None else readable_config(config, resolve_source(cfg.name_or_path))


def _stored_config(cfg: ModelSection, offline: bool) -> Any:
    from transformers import AutoConfig

    source = resolve_source(cfg.name_or_path)
    directory = Path(source).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise UserError(
                f"model.name_or_path: {source} holds no config.json; give the directory of a saved model "
                "(config.json and its weights, as save_pretrained writes them)"
            )
        try:
            return AutoConfig.from_pretrained(directory)
        except (OSError, ValueError) as err:
            raise UserError(f"model.name_or_path: cannot read {directory / 'config.json'}: {err}") from None
    shipped = shipped_config_path(source)
    if offline or (cfg.random_init and shipped):
        if shipped:
            return AutoConfig.from_pretrained(shipped)
        try:
            return AutoConfig.from_pretrained(source, revision=cfg.revision, local_files_only=True)
        except OSError:
            return None
    try:
        return AutoConfig.from_pretrained(source, revision=cfg.revision)
    except OSError as err:
        raise UserError(f"model.name_or_path: cannot load the config of {source!r}: {err}") from None


def require_config(recipe: Recipe) -> Any:
    """The model's architecture, offline: a local or shipped config.json (read as JSON, nothing heavy
    imported), else transformers' cache. A UserError says how to supply it when there is none."""
    source = resolve_source(recipe.model.name_or_path)
    local = Path(source).expanduser() / "config.json"
    path = local if local.is_file() else shipped_config_path(source)
    if path is not None:
        return _with_towers(_with_class_defaults(json.loads(path.read_text())))
    config = load_config(recipe.model, offline=True)
    if config is None:
        name = recipe.model.name_or_path
        raise UserError(
            f"model.name_or_path: the architecture of {name!r} is not available offline (nothing is downloaded). "
            f"Give a local directory that holds its config.json (model.name_or_path=/path/to/dir), or save its "
            f"config.json as {CONFIGS / (name.replace('/', '__') + '.json')}"
        )
    return _with_towers(config)


def _with_towers(config: Any) -> Any:
    """``config`` with the parameter count of a multimodal checkpoint's vision and audio towers set (the
    planner's ``TOWERS``: frozen weights in HBM beside a text step), counted on the meta device."""
    from lowmem_tpu.config.features import TOWERS

    if not any(getattr(config, name, None) for name in ("vision_config", "audio_config")):
        return config
    try:
        model = meta_model(config if hasattr(config, "to_dict") else _as_class_config(vars(config)))
    except (KeyError, ValueError, TypeError):  # an architecture transformers cannot build: towers not counted
        return config
    text = {id(p) for module in (model.get_decoder(), model.lm_head) for p in module.parameters()}
    setattr(config, TOWERS, sum(p.numel() for p in model.parameters() if id(p) not in text))
    return config


PLANNED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Fields of layers that differ (Gemma 4): transformers' config class derives each layer's shape from them.
PER_LAYER = ("global_head_dim", "num_kv_shared_layers", "hidden_size_per_layer_input")


def _with_class_defaults(raw: dict[str, Any]) -> Any:
    """A config.json as attributes; one that leaves out what the planner reads goes through its transformers
    config class, so each value left out takes the class default (Gemma leaves out ``tie_word_embeddings``,
    true; Gemma 3 4B+ most of its ``text_config``), and so does one whose layers differ (``PER_LAYER``).
    transformers is imported only then."""
    text = raw.get("text_config", raw)
    uniform = not any(key in text for key in PER_LAYER)
    if uniform and all(key in text for key in PLANNED) and "tie_word_embeddings" in {**raw, **text}:
        return SimpleNamespace(**raw)

    try:
        return _as_class_config(raw)
    except (KeyError, ValueError, TypeError):
        return SimpleNamespace(**raw)


def _as_class_config(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(raw["model_type"], **{key: value for key, value in raw.items() if key != "model_type"})


def torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def attention_name(cfg: ModelSection) -> str:
    """``model.attn_implementation`` as transformers knows it, registered (``chunked``, ``flash`` are ours)."""
    from lowmem_tpu.model.attention import register, transformers_name

    register(cfg.attn_implementation)
    return transformers_name(cfg.attn_implementation)


def build_kwargs(config: Any, cfg: ModelSection | None) -> dict[str, Any]:
    """What ``from_config`` is given: the recipe's dtype and attention, and ``static`` experts for a MoE
    model (transformers' default experts path does not run on XLA: ``model.experts``)."""
    kwargs: dict[str, Any] = {}
    if cfg is not None:
        kwargs = {"dtype": torch_dtype(cfg.dtype), "attn_implementation": attention_name(cfg)}
    from lowmem_tpu.config.features import experts_of
    from lowmem_tpu.model.experts import NAME, register

    if experts_of(config) is not None:
        register()
        kwargs["experts_implementation"] = NAME
    return kwargs


def meta_model(config: Any, cfg: ModelSection | None = None) -> Any:
    """The model's module tree with no memory behind it; with ``cfg``, in its dtype and quantized layout."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **build_kwargs(config, cfg))
    if cfg is not None and cfg.quantize != "none":
        from lowmem_tpu.model.quantize import QuantSpec, check_quantizable, swap_linears

        check_quantizable(config, cfg.quantize_lm_head, cfg.quantize)

        swap_linears(model, QuantSpec.of(cfg), cfg.quantize_lm_head, torch_dtype(cfg.dtype))
    return _for_training(model, cfg)


def _for_training(model: Any, cfg: ModelSection | None) -> Any:
    """No KV cache; with chunked or flash attention, Gemma 4's inputs kept whole (``keep_kv_shared_inputs_whole``)."""
    model.config.use_cache = False
    if cfg is not None and cfg.attn_implementation in ("chunked", "flash"):
        from lowmem_tpu.model.attention import keep_kv_shared_inputs_whole

        keep_kv_shared_inputs_whole(model)
    return model


def build_base_model(cfg: ModelSection, seed: int = 0, weights: Weights | None = None) -> Any:
    """The base causal LM on the host, in ``model.dtype``.

    ``weights``: ``checkpoint`` (read from ``name_or_path``, quantized as read if asked), ``random``
    (initialised from the config with ``seed``, in full precision: ``quantize_base`` quantizes it
    after it is saved as the adapter's base) or ``meta`` (no memory; the caller materializes it).
    The default is ``random`` when ``model.random_init`` is set, else ``checkpoint``.
    """
    import torch

    # Seeded whatever the weights: what is drawn next (LoRA's A matrices) is the same on every host of a pod
    # slice, in every run of the recipe, and again on resume; a checkpoint's base draws nothing itself.
    torch.manual_seed(seed)
    weights = weights or ("random" if cfg.random_init else "checkpoint")
    if weights == "meta":
        return meta_model(load_config(cfg, offline=True) or load_config(cfg), cfg)
    if weights == "random":
        from transformers import AutoModelForCausalLM

        config = load_config(cfg)
        model = AutoModelForCausalLM.from_config(config, **build_kwargs(config, cfg))
        return _for_training(model, cfg)
    return _from_checkpoint(cfg)


def quantize_base(model: Any, cfg: ModelSection) -> int:
    """Quantize a base built with random weights (in full precision); returns the layer count."""
    if cfg.quantize == "none":
        return 0
    from lowmem_tpu.model.quantize import QuantSpec, check_quantizable, quantize_model

    check_quantizable(model.config, cfg.quantize_lm_head, cfg.quantize)
    return quantize_model(model, QuantSpec.of(cfg), cfg.quantize_lm_head)


# ----------------------------------------------------------------------------- reading a checkpoint


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint files of a model directory: safetensors first, else PyTorch ``.bin``."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = directory / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [directory / shard for shard in shards]
        if (directory / single).is_file():
            return [directory / single]
    return []


def read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the files, one at a time (memory-mapped reads)."""
    import torch
    from safetensors import safe_open

    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name in list(state):
                yield name, state.pop(name)


def model_directory(source: str, revision: str | None) -> Path:
    """A local model directory, or the Hub snapshot of its config and weights (downloaded once)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import list_repo_files, snapshot_download

    try:
        files = list_repo_files(source, revision=revision)
        kind = "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"
        return Path(snapshot_download(source, revision=revision, allow_patterns=["*.json", kind]))
    except Exception as err:  # hub and network errors come in many types; each means "cannot fetch"
        raise UserError(
            f"model.name_or_path: cannot fetch the weights of {source!r} ({type(err).__name__}: {err}); "
            "give a local directory or a reachable Hub id"
        ) from None


def _from_checkpoint(cfg: ModelSection) -> Any:
    """Build on ``meta`` and fill from the checkpoint one tensor at a time (quantizing decoder linears if asked).

    Checkpoint names are mapped to the model's as ``from_pretrained`` maps them (transformers' own
    renamings: Gemma 3's multimodal ``language_model.model.*``, a missing base-model prefix), and
    what the checkpoint does not hold is computed as ``from_pretrained`` computes it.
    """
    import torch

    source = resolve_source(cfg.name_or_path)
    directory = model_directory(source, cfg.revision)
    files = weight_files(directory)
    if not files:
        raise UserError(
            f"model.name_or_path: {directory} holds no model.safetensors or pytorch_model.bin "
            "(or their .index.json); give the directory of a saved model"
        )
    model = meta_model(load_config(with_fields(cfg, name_or_path=str(directory), revision=None)), cfg)
    dtype = torch_dtype(cfg.dtype)
    expected = {name for name, _ in model.named_parameters()} | set(dict(model.named_buffers()))
    rename = _checkpoint_names(model, directory)
    stacks = ExpertStacks(model, dtype)
    with torch.no_grad():
        for stored, tensor in dequantized(read_tensors(files)):
            name, slot = rename(stored)
            layer = name.removesuffix(".weight")
            if slot is not None and name in expected:
                stacks.place(name, slot, tensor, stored)
            elif name in expected:
                _assign(model, name, tensor, dtype)
            elif layer != name and f"{layer}.qweight" in expected:
                model.get_submodule(layer).load_weight(tensor)
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
            model.tie_weights()
        missing = sorted({*(n for n, p in model.named_parameters() if p.is_meta), *stacks.incomplete()})
        if missing:  # never initialised in its place: a base must be the checkpoint's, whole
            raise UserError(
                f"model.name_or_path: {directory} lacks weights for {len(missing)} parameters "
                f"(first: {', '.join(missing[:3])}); is it a checkpoint of this architecture?"
            )
        _initialize_rest(model)
    _generation_config(model, directory)
    return model


def _checkpoint_names(model: Any, directory: Path) -> Callable[[str], tuple[str, Slot | None]]:
    """``stored name -> (model name, slot)``, as transformers' loader renames checkpoint keys for this model.

    A key that transformers merges into a stacked expert tensor (the Hub's one key per expert: Qwen 3 MoE's
    ``experts.3.gate_proj.weight`` into ``experts.gate_up_proj``) comes with its ``Slot`` in that stack.
    Any other conversion (split or permute tensors) cannot be read one tensor at a time: refused.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta_state = model.state_dict()

    def rename(stored: str) -> tuple[str, Slot | None]:
        name, pattern = rename_source_key(stored, renamings, converters, model.base_model_prefix, meta_state)
        if pattern is None:
            return name, None
        slot = expert_slot(next(c for c in converters if pattern in c.source_patterns), pattern, stored)
        if slot is None:
            raise UserError(
                f"model.name_or_path: {directory} stores {stored!r} in a layout transformers converts while "
                f"loading ({type(model).__name__}) and that cannot be read one tensor at a time; "
                "use a checkpoint of it with the model's own parameter names"
            )
        return name, slot

    return rename


def _generation_config(model: Any, directory: Path) -> None:
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    from torch import nn

    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    value = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _initialize_rest(model: Any) -> None:
    """What no checkpoint holds (rotary frequencies, Gemma's embedding scale), computed as ``from_pretrained`` does.

    Loaded tensors are flagged ``_is_hf_initialized``, which transformers' own init functions respect,
    and the model's ``initialize_weights`` then fills the non-persistent buffers, touching nothing loaded.
    """
    import torch

    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            tensor._is_hf_initialized = True
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.initialize_weights()
