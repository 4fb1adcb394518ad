"""The one way a recipe is validated: pydantic's field checks and the cross-field rules (``config.checks``),
every problem at once as ``dotted.path: message``. It reads the recipe only, never the machine
(``lowmem_tpu.preflight`` asks what this machine must have).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from lowmem_tpu.config.checks import CROSS_FIELDS
from lowmem_tpu.config.schema import Recipe
from lowmem_tpu.config.section import RecipeError


def _section(keys: tuple[str, ...]) -> type[BaseModel] | None:
    """The schema's section at ``keys`` (``()`` is the top level); None when not a section."""
    model: type[BaseModel] = Recipe
    for key in keys:
        annotation = getattr(model.model_fields.get(key), "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _section_fields(keys: tuple[str, ...]) -> list[str]:
    """Field names of the section at ``keys``; [] when not a section."""
    section = _section(keys)
    return list(section.model_fields) if section else []


def _description(keys: tuple[str, ...]) -> str:
    """The schema's description of the field at ``keys``."""
    section = _section(keys[:-1])
    field = section.model_fields.get(keys[-1]) if section else None
    text = str(getattr(field, "description", None) or "a mapping of names to values").rstrip(".")
    return text[:1].lower() + text[1:]


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


# Keys recipes once had, with what replaces them.
# Keys recipes once had: their default then (every run's saved recipe.yaml spells it out, and it means what a
# recipe without the key means now) and, for any other value, what replaces the key.
REMOVED = {
    "data.text_field": ("text", "name the column with data.columns: {text: COLUMN}"),
    "data.messages_field": ("messages", "name the column with data.columns: {messages: COLUMN}"),
    "sharding.offload_activations": (
        False,
        "host offload saved no HBM per the TPU compiler; remove it (docs/memory.md lists the levers that do)",
    ),
}


def without_removed(data: dict[str, Any]) -> dict[str, Any]:
    """A recipe mapping without the removed keys that hold their old default (a run saved before they went)."""
    out = {section: dict(value) if isinstance(value, dict) else value for section, value in data.items()}
    for path, (default, _) in REMOVED.items():
        section, key = path.split(".")
        if isinstance(out.get(section), dict) and key in out[section] and out[section][key] == default:
            del out[section][key]
    return out


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
        if path in REMOVED:
            return [f"{path}: no longer a recipe key: {REMOVED[path][1]}"]
        suggestion = _suggest(keys)
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        valid = _section_fields(keys[:-1])
        return [f"{path}: unknown key{hint} (valid: {', '.join(valid)})"]
    if first["type"] in {"model_type", "dict_type"} and len(errors) == 1:
        valid = ", ".join(_section_fields(keys))
        if not valid:  # a mapping field, not a section (data.columns): its description says what it maps
            return [f"{path}: must be a mapping{_got(first.get('input'))}; {_description(keys)}"]
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
    data = with_adapter_settings(without_removed(data))
    problems: list[str] = []
    removed: list[tuple[str, ...]] = []
    recipe = None
    for _ in range(4):  # a second pass normally succeeds; the bound guards against surprises
        try:
            recipe = Recipe.model_validate(data)
            break
        except ValidationError as err:
            grouped: dict[tuple[str, ...], list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
            for error in err.errors():
                keys, rest = _split_loc(tuple(error["loc"]))
                if error["type"] == CROSS_FIELDS:  # every field valid: the rules across fields (config.checks)
                    cross = error["ctx"]["problems"]
                    problems.extend(message for fields, message in cross if not _involves(fields, removed))
                elif keys:
                    grouped.setdefault(keys, []).append((rest, error))
                else:
                    problems.extend(_message(error).splitlines())
            if not grouped:
                break
            for keys, errors in grouped.items():
                problems.extend(_describe(keys, errors))
                removed.append(keys)
                data = _without(data, keys)
    if problems or recipe is None:
        raise RecipeError(list(dict.fromkeys(problems)) or ["recipe: invalid"])
    return recipe


def with_adapter_settings(data: dict[str, Any]) -> dict[str, Any]:
    """``model.adapter`` is trained with its own LoRA settings: its rank, alpha, dropout, targets, rsLoRA and DoRA
    replace ``lora.*`` before validation, so the checks, the planner, ``show`` and the card see what trains. An
    adapter that is not a local directory (a Hub id) keeps the recipe's, read when it loads."""
    adapter = (data.get("model") or {}).get("adapter") if isinstance(data.get("model"), dict) else None
    path = Path(str(adapter or "")).expanduser() / "adapter_config.json"
    if not adapter or not path.is_file():
        return data
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError([f"model.adapter: {path} is not readable JSON ({err})"]) from None
    keys = {
        "r": "r",
        "lora_alpha": "alpha",
        "lora_dropout": "dropout",
        "use_rslora": "use_rslora",
        "use_dora": "use_dora",
    }
    lora = dict(data.get("lora") or {}) | {ours: saved[theirs] for theirs, ours in keys.items() if theirs in saved}
    targets = saved.get("target_modules")
    if isinstance(targets, list) or targets == "all-linear":
        lora["target_modules"] = sorted(targets) if isinstance(targets, list) else targets
    return {**data, "lora": lora}
