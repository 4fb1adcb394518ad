"""The recipe as data: ``schema``, ``model_fields`` and ``preference_fields`` (the fields, described;
``section``: their base and ``RecipeError``), ``checks`` (rules across fields), ``validate`` (the one entry:
every problem at once), ``methods`` (the training methods as data: what each reads, holds and logs), ``read``
(YAML, ``extends``, overrides), ``shipped`` (the shipped recipes by name), ``rules`` (a batch's split,
durations), ``devices`` (the TPU VM catalog), ``features`` (what a model's config asks of attention and the
loss) and ``assets`` (``builtin:`` files).

Owns every recipe field and every user-facing word about one. A recipe's validity never depends on
the machine (``lowmem_tpu.preflight`` asks what this one must have). Imports nothing of ours but
``errors``, and nothing heavy (no torch), so ``--help``, ``validate`` and ``show`` stay fast.
"""

from lowmem_tpu.config.model_fields import LoraSection, ModelSection
from lowmem_tpu.config.read import (
    apply_overrides,
    find_recipe,
    load_recipe,
    read_recipe_file,
    shipped_recipes,
    with_fields,
    with_overrides,
)
from lowmem_tpu.config.rules import micro_batch_size, parse_duration
from lowmem_tpu.config.schema import (
    DataSection,
    HubSection,
    PreferenceSection,
    Recipe,
    RuntimeSection,
    ShardingSection,
    TrainSection,
)
from lowmem_tpu.config.section import RecipeError
from lowmem_tpu.config.validate import validate_recipe

__all__ = [
    "DataSection",
    "HubSection",
    "LoraSection",
    "ModelSection",
    "PreferenceSection",
    "Recipe",
    "RecipeError",
    "RuntimeSection",
    "ShardingSection",
    "TrainSection",
    "apply_overrides",
    "find_recipe",
    "load_recipe",
    "micro_batch_size",
    "parse_duration",
    "read_recipe_file",
    "shipped_recipes",
    "validate_recipe",
    "with_fields",
    "with_overrides",
]
