"""What a run wrote, loaded back as the run built it: a LoRA adapter on its base, or a merged/full model.

An adapter's base is found as ``lowmem-tpu merge`` finds it (the one ``adapter_config.json`` records,
or ``--base``) and built by the training loader, quantized when the run's recipe quantized it
(a QLoRA adapter is evaluated on the int8/int4 base it was trained on). The tokenizer is the one
saved beside the weights, chat template included; ``recipe.yaml`` says how prompts were formatted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.config import ModelSection
from lowmem_tpu.errors import UserError
from lowmem_tpu.files import check_whole, checkpoint_instead
from lowmem_tpu.publish.adapter_base import adapter_tokenizer, choose_base, read_adapter_config, read_recipe_data

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Trained:
    """A trained model on the host, its tokenizer, and what its run's recipe says about prompts."""

    model: Any
    tokenizer: Any
    kind: str  # "adapter" or "model"
    directory: Path
    recipe: dict[str, Any]  # the run's resolved recipe.yaml as data ({} when absent)
    base: str | None  # an adapter's base

    @property
    def data_format(self) -> str | None:
        """chat, alpaca or text: how training formatted prompts (None without a recipe)."""
        return self.recipe.get("data", {}).get("format")

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 2048))


def kind_of(directory: Path) -> str:
    """``adapter`` or ``model``; a UserError naming what is missing otherwise."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory; give output_dir/final of a run, or a merged model")
    check_whole(directory)
    if (directory / ADAPTER_CONFIG).is_file():
        return "adapter"
    if err := checkpoint_instead(directory):
        raise err
    weights = [*directory.glob("*.safetensors"), *directory.glob("pytorch_model*.bin")]
    if (directory / "config.json").is_file() and weights:
        return "model"
    raise UserError(
        f"{directory} is neither a LoRA adapter (adapter_config.json) nor a model (config.json and weights); "
        "give output_dir/final of a run, or the output of lowmem-tpu merge"
    )


def load_trained(directory: Path, *, base: str | None = None, force: bool = False) -> Trained:
    """The model in ``directory`` on the host, in the dtype (and base quantization) its run trained it in."""
    from lowmem_tpu.model import build_base_model, load_tokenizer

    directory = Path(directory)
    kind = kind_of(directory)
    recipe = read_recipe_data(directory)
    model_cfg = recipe.get("model", {})
    dtype = model_cfg.get("dtype", "float32")
    if kind == "model":
        model = _build(build_base_model, ModelSection(name_or_path=str(directory), dtype=dtype), str(directory))
        section = ModelSection(
            name_or_path=str(directory),
            use_fast_tokenizer=model_cfg.get("use_fast_tokenizer", True),
            pad_token=model_cfg.get("pad_token"),
        )
        return Trained(model.eval(), load_tokenizer(section), kind, directory, recipe, None)
    config = read_adapter_config(directory)
    choice = choose_base(config, directory, base, None, force)
    section = ModelSection(
        name_or_path=choice.source,
        revision=choice.revision,
        dtype=dtype,
        quantize=model_cfg.get("quantize", "none"),
        quantize_group_size=model_cfg.get("quantize_group_size", 64),
        quantize_double=model_cfg.get("quantize_double"),
        quantize_lm_head=model_cfg.get("quantize_lm_head", False),
    )
    from peft import PeftModel

    model = PeftModel.from_pretrained(_build(build_base_model, section, choice.source), str(directory))
    return Trained(model.eval(), adapter_tokenizer(directory, choice), kind, directory, recipe, choice.source)


def _build(builder: Any, section: ModelSection, source: str) -> Any:
    try:
        return builder(section)
    except UserError as err:
        raise UserError(f"cannot load the model {source!r}: {err}") from None
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"cannot load the model {source!r}: {type(err).__name__}: {err}") from None
