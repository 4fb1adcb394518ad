"""Reading a recipe: YAML files, ``extends`` chains, dotted overrides, shipped recipes by name.

A recipe with overrides is made one way, :func:`with_overrides` (validated by ``config.validate``);
a section with other values, :func:`with_fields` (pydantic's ``model_copy(update=...)`` validates nothing).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from lowmem_tpu.config.schema import Recipe
from lowmem_tpu.config.section import RecipeError
from lowmem_tpu.config.validate import validate_recipe

Section = TypeVar("Section", bound=BaseModel)

RECIPES = Path(__file__).parent.parent / "recipes"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus YAML 1.2 floats without a dot (``3e-4``, ``1e5``); a key given twice
    in one mapping is an error (YAML would keep the last and silently drop the first's fields)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key, str | int | float | bool):
                continue
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{key!r} is given twice (lines {first[key] + 1} and {key_node.start_mark.line + 1}): "
                    "YAML would keep only the second; merge the two into one",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


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
    except OSError as err:  # a parent that is a file, no permission, ...
        raise RecipeError([f"{where}: cannot read {_show(path)}: {err.strerror}"]) from None
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

    ``extends`` names a file relative to the recipe that names it, else a shipped recipe by name
    (``extends: open_llama_lora.yaml`` from a recipe of one's own, anywhere).
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
    named = path.parent / Path(parent).expanduser()
    if not named.exists() or named.resolve() == resolved:  # my open_llama_lora.yaml extending the shipped one
        named = _shipped(parent) or named
    return _deep_merge(read_recipe_file(named, (*_chain, resolved)), data)


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


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load, merge, override and validate a recipe (the embedded default when ``path`` is None).

    ``path`` is a file, or the bare name of a shipped recipe (``open_llama_lora``).
    """
    data = read_recipe_file(find_recipe(path) if path else default_recipe_path())
    return with_overrides(data, overrides or [])


def with_overrides(recipe: Recipe | Mapping[str, Any], overrides: list[str]) -> Recipe:
    """A recipe (or a recipe's mapping, e.g. a run's recipe.yaml) with ``section.key=value`` overrides applied,
    validated as a whole: every place that changes a recipe makes the new one here."""
    data = recipe.model_dump(mode="json", exclude={"extends"}) if isinstance(recipe, Recipe) else dict(recipe)
    return validate_recipe(apply_overrides(data, overrides))


def with_fields(section: Section, **changes: Any) -> Section:
    """A copy of a recipe section (``ModelSection``, ``RuntimeSection``, ...) with ``changes``, validated."""
    return type(section).model_validate(section.model_dump() | changes)


def default_recipe_path() -> Path:
    """The embedded default: a tiny Llama learning a string task on CPU devices."""
    return RECIPES / "tiny_lora_cpu.yaml"


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped in the package, by name (file name without .yaml)."""
    return {p.stem: p for p in sorted(RECIPES.glob("*.yaml"))}


def _shipped(name: str | Path) -> Path | None:
    """The shipped recipe a bare name, or recipes/NAME.yaml as the README spells it, means (None if none)."""
    path = Path(name)
    shipped = shipped_recipes().get(path.name.removesuffix(".yaml"))
    return shipped if shipped is not None and path.parent in (Path("."), Path("recipes")) else None


def find_recipe(name: str | Path) -> Path:
    """A recipe file: an existing path, else a shipped recipe named ``name`` (with or without .yaml)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    shipped = _shipped(name)
    if shipped is not None:
        return shipped
    if path.parent == Path(".") and not path.suffix:
        names = ", ".join(shipped_recipes())
        raise RecipeError([f"recipe: no file {name!r} and no shipped recipe of that name (shipped: {names})"])
    return path
