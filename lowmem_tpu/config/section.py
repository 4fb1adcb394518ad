"""The base of every recipe section, and the error a recipe that cannot be used raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from lowmem_tpu.errors import UserError


class RecipeError(UserError):
    """A recipe that cannot be used; ``problems`` lists every ``dotted.path: message``."""


class Section(BaseModel):
    """A recipe section: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
