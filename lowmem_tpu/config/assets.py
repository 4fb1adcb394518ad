"""``builtin:`` assets shipped in the package, and telling local paths from Hub ids."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

BUILTIN = "builtin:"
ASSETS = Path(__file__).parent.parent / "assets"
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CHAT_TEMPLATES = ASSETS / "chat_templates"


def chat_template_names() -> list[str]:
    """The chat templates shipped by name (``data.chat_template: plain``)."""
    return sorted(p.stem for p in CHAT_TEMPLATES.glob("*.jinja"))


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


def check_source(value: str, what: Literal["model", "dataset"]) -> str:
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
