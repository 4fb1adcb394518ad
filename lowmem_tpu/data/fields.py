"""Reading a record's fields: which column holds each field of the format, and what a valid value is.

A format names its fields (``config.schema.FORMAT_FIELDS``); ``data.columns`` says which column holds each
(by default the field's own name). Every reader fails with a
``DataError`` naming the record, the column and the fix; never a KeyError or a silent default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.config.schema import FORMAT_FIELDS
from lowmem_tpu.data.sources import DataError

if TYPE_CHECKING:
    import datasets

OPTIONAL = {("alpaca", "input"), ("preference", "prompt")}  # a preference prompt may be implicit
# ShareGPT speakers as chat roles: FastChat's human/gpt, and the names other exports use.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
}
CHAT_LIKE = ("chat", "sharegpt")
FIX = "fix or remove that record"


def column(cfg: DataSection, field: str) -> str:
    """The column that holds ``field`` of the recipe's format."""
    return cfg.columns.get(field, field)


def require_columns(records: datasets.Dataset, cfg: DataSection, source: str) -> None:
    """Fail, naming the columns found and the setting that would read them, when the format's are missing."""
    found = list(records.column_names)
    fields = FORMAT_FIELDS[cfg.format]
    wanted = {field: column(cfg, field) for field in fields}
    missing = [name for field, name in wanted.items() if name not in found and (cfg.format, field) not in OPTIONAL]
    if not missing:
        return
    shown = ", ".join(f"{name} (optional)" if (cfg.format, f) in OPTIONAL else name for f, name in wanted.items())
    raise DataError(
        f"{source}: data.format {cfg.format} reads the column(s) {shown} but the data has: {', '.join(found)}; "
        f"missing: {', '.join(missing)}; {suggest(found, cfg.format)}"
    )


def suggest(found: list[str], current: str) -> str:
    """The format (or column map) that would read records with these columns."""
    names = set(found)
    for fmt, fields in sorted(FORMAT_FIELDS.items(), key=lambda item: -len(item[1])):  # the most fields first
        needed = {f for f in fields if (fmt, f) not in OPTIONAL}
        if fmt != current and needed <= names:
            return f"the columns look like {fmt} data: set data.format: {fmt}"
    answer = next((c for c in ("response", "output", "answer", "completion", "target") if c in names), None)
    question = next((c for c in ("instruction", "question", "prompt", "query", "input") if c in names), None)
    if answer and question and question != answer:
        extra = next((c for c in ("context", "input") if c in names and c != question), None)
        mapped = f"instruction: {question}" + (f", input: {extra}" if extra else "") + f", output: {answer}"
        return f"to read them as instructions: data.format: alpaca with data.columns: {{{mapped}}}"
    fields = "; ".join(f"{fmt}: {', '.join(fs)}" for fmt, fs in FORMAT_FIELDS.items())
    return f"map the format's fields to these columns with data.columns (the fields: {fields})"


def string(record: dict[str, Any], cfg: DataSection, field: str, where: str) -> str:
    """A string field; an optional one that is absent or null reads as empty."""
    name = column(cfg, field)
    value = record.get(name)
    if value is None and (cfg.format, field) in OPTIONAL:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: column {name!r} ({cfg.format} {field}) must be a string, not {show(value)}; {FIX}")
    return value


def is_conversation(value: Any) -> bool:
    """A prompt or completion given as messages (TRL's conversational prompt-completion)."""
    return isinstance(value, list)


def messages(record: dict[str, Any], cfg: DataSection, field: str, where: str) -> list[dict[str, str]]:
    """A conversation as [{role, content}] from ``field`` (chat, a conversational prompt or completion) or
    from ShareGPT turns (``{from, value}``; ``{role, content}`` turns are read as they are)."""
    name = column(cfg, field)
    return as_messages(record.get(name), f"{where}: column {name!r}", sharegpt=cfg.format == "sharegpt")


def as_messages(value: Any, what: str, sharegpt: bool = False) -> list[dict[str, str]]:
    """``value`` as [{role, content}] (``what`` names it in the error: record and column)."""
    problem = f"{what} must be a non-empty list of {{role, content}} messages"
    if sharegpt:
        problem = f"{what} must be a non-empty list of {{from, value}} turns"
    if not isinstance(value, list) or not value:
        raise DataError(f"{problem}, not {show(value)}; {FIX}")
    return [_message(turn, problem) for turn in value]


def _message(turn: Any, problem: str) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise DataError(f"{problem}; got {show(turn)}; {FIX}")
    turn = {key: item for key, item in turn.items() if item is not None}  # datasets fills absent keys with None
    if "from" in turn:
        speaker = turn["from"]
        role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join(sorted(SHAREGPT_ROLES))
            raise DataError(f"{problem}; unknown speaker {speaker!r} (known: {known}); {FIX}")
        turn = {"role": role, "content": turn.get("value")}
    if not isinstance(turn.get("role"), str):
        raise DataError(f"{problem}; got {show(turn)}; {FIX}")
    if not isinstance(turn.get("content"), str):
        raise DataError(f"{problem}; a {turn['role']} message has no string content; {FIX}")
    return turn


def conversation(record: dict[str, Any], cfg: DataSection, where: str) -> list[dict[str, str]]:
    """The whole conversation of a chat or ShareGPT record."""
    return messages(record, cfg, "conversations" if cfg.format == "sharegpt" else "messages", where)


def show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}" if value is not None else "missing or null"
