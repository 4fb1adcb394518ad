"""The recipe system: schema, loading (YAML, ``extends``, overrides, shipped recipes), messages.

Owns every recipe field and every user-facing word about one. Imports nothing of ours but
``errors``, and nothing heavy (no torch), so ``--help``, ``validate`` and ``show`` stay fast.
"""

from lowmem_tpu.config.loading import apply_overrides, find_recipe, load_recipe, read_recipe_file, shipped_recipes
from lowmem_tpu.config.messages import validate_recipe
from lowmem_tpu.config.rules import micro_batch_size, parse_duration
from lowmem_tpu.config.schema import (
    DataSection,
    HubSection,
    LoraSection,
    ModelSection,
    Recipe,
    RecipeError,
    RuntimeSection,
    ShardingSection,
    TrainSection,
)

__all__ = [
    "DataSection",
    "HubSection",
    "LoraSection",
    "ModelSection",
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
]
