"""Each training method's TRL config and trainer (the method itself, as data: ``config.methods``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowmem_tpu.train.args import preference_args, training_args
from lowmem_tpu.train.preference import XlaPreferenceTrainer
from lowmem_tpu.train.trainer import XlaSFTTrainer, trainer_kwargs

# method -> (its TRL config from the recipe and the micro-batch, the trainer that runs it). ORPO, CPO and SimPO
# and KTO run on the preference trainer (TRL's DPOTrainer with their losses: ``train.pair_loss``).
TRAINERS: dict[str, tuple[Callable[[Any, int], Any], type]] = {
    "sft": (training_args, XlaSFTTrainer),
    "dpo": (preference_args, XlaPreferenceTrainer),
    "orpo": (preference_args, XlaPreferenceTrainer),
    "cpo": (preference_args, XlaPreferenceTrainer),
    "simpo": (preference_args, XlaPreferenceTrainer),
    "kto": (preference_args, XlaPreferenceTrainer),
}


def build_method_trainer(
    recipe: Any,
    runtime: Any,
    model: Any,
    train_dataset: Any,
    tokenizer: Any,
    micro_batch: int,
    callbacks: list[Any],
    **extra: Any,
) -> XlaSFTTrainer | XlaPreferenceTrainer:
    """The trainer of ``recipe.method`` on a model already placed on the devices; ``extra``: ``trainer_kwargs``'s
    keywords."""
    make_args, trainer = TRAINERS[recipe.method]
    kwargs = trainer_kwargs(recipe, runtime, model, train_dataset, tokenizer, callbacks, **extra)
    if trainer is XlaPreferenceTrainer:
        kwargs["fresh_adapters"] = recipe.model.adapter is None
    return trainer(args=make_args(recipe, micro_batch), **kwargs)
