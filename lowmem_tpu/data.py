"""Training data: load records, format them, tokenize them to static shapes.

XLA compiles one graph per input shape, so every row this module returns has
exactly ``data.max_length`` tokens: a ragged batch would recompile the step (minutes
on a TPU) for every new length. Padding is wasted compute; ``data.packing`` trades
it for cross-sample attention.

Labels are not shifted (the model shifts them) and are ``-100`` wherever nothing
should be learned: padding, and with ``data.mask_prompt`` the prompt. Padding is
found by position, never by comparing ids with the pad id, because the pad token
may be the EOS, which must still be learned.

``datasets``, ``numpy`` and ``torch`` are imported inside the functions that use them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_tpu.errors import UserError
from lowmem_tpu.recipe import BUILTIN, DataSection, looks_local, resolve_builtin

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import torch

IGNORE_INDEX = -100
COLUMNS = ("input_ids", "attention_mask", "labels")
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

Sample = tuple[Any, Any]  # (input_ids, labels) of one record, any length: lists, then int32 arrays


class DataError(UserError):
    """A user error in the data (the CLI prints it and exits 2). Message names the problem and the fix."""


# --------------------------------------------------------------------------- loading


def load_records(path: str, split: str = "train") -> datasets.Dataset:
    """Records of ``builtin:NAME``, a local .jsonl/.json/.csv/.parquet file (or directory), or a Hub dataset.

    JSON files are checked line by line first, so a malformed one fails with its line number.
    """
    if path.startswith(BUILTIN):
        file = resolve_builtin(path)
        if not file.exists():
            raise DataError(f"no built-in dataset {path!r} (looked for {file})")
        return _load_local(file, split)
    if looks_local(path):
        file = Path(path).expanduser()
        if not file.exists():
            raise DataError(f"data file not found: {path} (give an existing file or a Hub dataset id)")
        return _load_local(file, split)
    return _load(
        path,
        f"could not load the Hub dataset {path!r} (split {split!r})",
        "give a local .jsonl/.json/.csv/.parquet file instead (no network, or a wrong name or split?)",
        split=split,
    )


def _load_local(file: Path, split: str) -> datasets.Dataset:
    if file.is_dir():
        return _load(str(file), f"could not load the dataset directory {file}", "give one data file", split=split)
    builder = BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise DataError(f"{file}: unsupported file type {file.suffix!r}; use one of {', '.join(BUILDERS)}")
    if file.suffix.lower() == ".jsonl":
        _check_json_lines(file)
    elif builder == "json":
        _check_json(file)
    records = _load(builder, f"could not read {file}", "check the file", data_files=str(file), split="train")
    if len(records) == 0:
        raise DataError(f"{file} holds no records")
    return records


def _load(name: str, failure: str, fix: str, **kwargs: Any) -> datasets.Dataset:
    import datasets

    try:
        return datasets.load_dataset(name, **kwargs)
    except Exception as err:  # datasets raises many types (network, schema, parse); all are user-facing here
        raise DataError(f"{failure}: {type(err).__name__}: {err}; {fix}") from err


def _check_json_lines(file: Path) -> None:
    """Fail on the first line of a JSON-lines file that is not one JSON object, or on an empty file."""
    records = 0
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{file}: line {number} is not valid JSON ({err.msg}, column {err.colno}); "
                    "each line must hold one JSON object (a JSON array belongs in a .json file)"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{file}: line {number} is a JSON {type(record).__name__}, not an object")
            records += 1
    if not records:
        raise DataError(f"{file} holds no records")


def _check_json(file: Path) -> None:
    """A .json file is either one array of objects or JSON lines."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.lstrip().startswith("["):
        _check_json_lines(file)
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{file}: line {err.lineno} is not valid JSON ({err.msg}, column {err.colno})") from None
    for index, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise DataError(f"{file}: item {index} of the array is a JSON {type(record).__name__}, not an object")
    if not records:
        raise DataError(f"{file} holds no records")


# --------------------------------------------------------------------------- checks


def _require_columns(records: datasets.Dataset, cfg: DataSection, source: str) -> None:
    """Fail, naming the columns found and the recipe field to set, when the format's columns are missing."""
    columns = list(records.column_names)
    if cfg.format == "text":
        expected, fix = [cfg.text_field], "set data.text_field to the column that holds the text"
    elif cfg.format == "chat":
        expected, fix = [cfg.messages_field], "set data.messages_field to the column that holds the conversation"
    else:
        expected, fix = ["instruction", "output"], "alpaca data needs instruction, output and optionally input"
    missing = [name for name in expected if name not in columns]
    if not missing:
        return
    guess = _guess_format(columns)
    hint = f"; the columns look like {guess} data: set data.format: {guess}" if guess and guess != cfg.format else ""
    wanted = ", ".join(expected) + (", input (optional)" if cfg.format == "alpaca" else "")
    raise DataError(
        f"{source}: data.format {cfg.format} expects the column(s) {wanted} but found: {', '.join(columns)}; "
        f"missing: {', '.join(missing)}; {fix}{hint}"
    )


def _guess_format(columns: list[str]) -> str | None:
    if "messages" in columns:
        return "chat"
    if {"instruction", "output"} <= set(columns):
        return "alpaca"
    return "text" if "text" in columns else None


def _string(record: dict[str, Any], field: str, where: str, setting: str, optional: bool = False) -> str:
    value = record.get(field)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {setting} {field!r} must be a string, not {type(value).__name__}")
    return value


def _messages(record: dict[str, Any], cfg: DataSection, where: str) -> list[dict[str, Any]]:
    """The conversation of a chat record as plain dicts (keys that ``datasets`` filled with None are dropped)."""
    value = record.get(cfg.messages_field)
    problem = f"{where}: data.messages_field {cfg.messages_field!r} must be a list of {{role, content}} messages"
    if not isinstance(value, list) or not value:
        raise DataError(f"{problem}, not {value!r:.80}")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{problem}; got {message!r:.80}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{problem}; a {message['role']} message has no string content")
        messages.append({key: item for key, item in message.items() if item is not None})
    return messages


def _check_tokenizer(tokenizer: Any, cfg: DataSection) -> None:
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token: set model.pad_token (padding is masked by position)")
    if cfg.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.format chat needs a chat template but the tokenizer has none: use a chat model's tokenizer "
            "(model.tokenizer) or data.format alpaca/text"
        )
    if cfg.format != "chat" and tokenizer.eos_token_id is None:
        raise DataError(f"data.format {cfg.format} ends every sample with EOS but the tokenizer has no eos token")


# --------------------------------------------------------------------------- formatting


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _bos(tokenizer: Any) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The fixed Alpaca-style prompt (with or without an input) that precedes the output."""
    template = ALPACA_PROMPT if input.strip() else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=instruction, input=input)


def _alpaca_fields(record: dict[str, Any], where: str) -> tuple[str, str]:
    """(prompt text, output) of an alpaca record."""
    instruction = _string(record, "instruction", where, "column")
    extra = _string(record, "input", where, "column", optional=True)
    return alpaca_prompt(instruction, extra), _string(record, "output", where, "column")


def _encode_text(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    (ids,) = _tokenize(tokenizer, [_string(record, cfg.text_field, where, "data.text_field")])
    ids = _bos(tokenizer) + ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def _encode_alpaca(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    prompt, output = _alpaca_fields(record, where)
    # Prompt and output are tokenized apart so the boundary is exact and the prompt tokens are the very
    # ones exact_match_prompts feeds to generation.
    prompt_ids, output_ids = _tokenize(tokenizer, [prompt, output])
    prompt_ids = _bos(tokenizer) + prompt_ids
    completion = [*output_ids, tokenizer.eos_token_id]
    prompt_labels = [IGNORE_INDEX] * len(prompt_ids) if cfg.mask_prompt else prompt_ids
    return prompt_ids + completion, prompt_labels + completion


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # a template is user code: jinja errors, raise_exception(), KeyError...
        raise DataError(f"{where}: the chat template failed on this conversation: {err}") from err


def _encode_chat(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    """Tokens of the rendered conversation; with mask_prompt only the assistant turns are trained.

    An assistant turn spans from the end of the conversation before it rendered with the generation
    prompt to the end of the conversation including it, so whatever the template appends after the
    content (EOS, newline) is trained too. Both renderings must tokenize to prefixes of the whole.
    """
    messages = _messages(record, cfg, where)
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    texts = [_render(tokenizer, messages, False, where)]
    if cfg.mask_prompt:
        for i in turns:
            texts += [
                _render(tokenizer, messages[:i], True, where),
                _render(tokenizer, messages[: i + 1], False, where),
            ]
    ids, *prefixes = _tokenize(tokenizer, texts)
    if not cfg.mask_prompt:
        return ids, list(ids)
    if any(ids[: len(prefix)] != prefix for prefix in prefixes):
        raise DataError(
            f"{where}: the chat template is not prefix-stable (a conversation rendered up to a turn does not "
            "tokenize to a prefix of the whole one), so the assistant turns cannot be located; "
            "set data.mask_prompt: false to train on every token"
        )
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in zip(prefixes[::2], prefixes[1::2], strict=True):
        labels[len(start) : len(end)] = ids[len(start) : len(end)]
    return ids, labels


ENCODERS = {"text": _encode_text, "alpaca": _encode_alpaca, "chat": _encode_chat}


# --------------------------------------------------------------------------- static shapes


def build_dataset(
    cfg: DataSection,
    tokenizer: Any,
    *,
    path: str | None = None,
    split: str | None = None,
    max_samples: int | None = None,
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Load, format and tokenize ``path`` (default ``cfg.path``) into rows of exactly ``cfg.max_length`` tokens.

    Every row has ``input_ids``, ``attention_mask`` and ``labels`` (unshifted, -100 on padding and masked
    prompts), right-padded with the pad token. Samples longer than max_length follow ``cfg.too_long``
    (with packing too: a split sample would lose its prompt); samples with no trained token left are
    dropped. With ``cfg.packing`` the samples are concatenated and cut into full rows (only the last is
    padded); this packing is naive: samples sharing a row can attend to each other.

    Returns the dataset and stats: samples (records read), rows, truncated, dropped, longest (tokens of
    the longest sample), tokens (real tokens in the rows) and trained_tokens (labels that are not -100).
    """
    import datasets
    import numpy as np

    _check_tokenizer(tokenizer, cfg)
    path = path or cfg.path
    records = load_records(path, split or cfg.split)
    _require_columns(records, cfg, path)
    limit = max_samples if max_samples is not None else cfg.max_samples
    if limit is not None:
        records = records.select(range(min(limit, len(records))))
    encode = ENCODERS[cfg.format]
    # int32 arrays, not lists of Python ints: a large dataset is held in host memory at once.
    samples = [
        tuple(np.asarray(part, dtype=np.int32) for part in encode(record, cfg, tokenizer, f"{path}: record {i}"))
        for i, record in enumerate(records, 1)
    ]
    if not samples:
        raise DataError(f"{path}: no records to train on")
    kept, counts = _fit(samples, cfg)
    arrays = (_pack if cfg.packing else _pad)(kept, cfg.max_length, tokenizer.pad_token_id)
    stats = {
        "samples": len(samples),
        "rows": len(arrays["input_ids"]),
        **counts,
        "tokens": int(arrays["attention_mask"].sum()),
        "trained_tokens": int((arrays["labels"] != IGNORE_INDEX).sum()),
    }
    return datasets.Dataset.from_dict(arrays), stats


def _fit(samples: list[Sample], cfg: DataSection) -> tuple[list[Sample], dict[str, int]]:
    """Apply ``cfg.too_long`` and drop samples with nothing to train; return the kept samples and the counts."""
    limit = cfg.max_length
    lengths = [len(ids) for ids, _ in samples]
    too_long = sum(length > limit for length in lengths)
    if too_long and cfg.too_long == "error":
        raise DataError(
            f"{too_long} of {len(samples)} samples are longer than data.max_length={limit} tokens "
            f"(the longest has {max(lengths)}); raise data.max_length or set data.too_long: truncate or drop"
        )
    dropped_long = too_long if cfg.too_long == "drop" else 0
    if cfg.too_long == "drop":
        samples = [sample for sample in samples if len(sample[0]) <= limit]
    else:
        samples = [(ids[:limit], labels[:limit]) for ids, labels in samples]
    kept = [sample for sample in samples if (sample[1] != IGNORE_INDEX).any()]
    untrained = len(samples) - len(kept)
    if not kept:
        reasons = [f"{untrained} had no trained token (no assistant turn, or the answer was truncated away)"]
        if dropped_long:
            reasons.insert(0, f"{dropped_long} were longer than data.max_length={limit} (data.too_long: drop)")
        raise DataError(
            f"no samples left to train on: of {len(lengths)}, {' and '.join(reasons)}; "
            "check the data or raise data.max_length"
        )
    counts = {"truncated": too_long - dropped_long, "dropped": dropped_long + untrained, "longest": max(lengths)}
    return kept, counts


def _pad(samples: list[Sample], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One right-padded row per sample."""
    arrays = _empty(len(samples), length, pad_id)
    for row, (ids, labels) in enumerate(samples):
        arrays["input_ids"][row, : len(ids)] = ids
        arrays["attention_mask"][row, : len(ids)] = 1
        arrays["labels"][row, : len(ids)] = labels
    return arrays


def _pack(samples: list[Sample], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """All samples end to end, cut into rows of ``length``; only the last row is padded."""
    import numpy as np

    ids = np.concatenate([sample_ids for sample_ids, _ in samples])
    labels = np.concatenate([sample_labels for _, sample_labels in samples])
    rows = -(-len(ids) // length)
    arrays = _empty(rows, length, pad_id)
    arrays["input_ids"].reshape(-1)[: len(ids)] = ids
    arrays["attention_mask"].reshape(-1)[: len(ids)] = 1
    arrays["labels"].reshape(-1)[: len(ids)] = labels
    return arrays


def _empty(rows: int, length: int, pad_id: int) -> dict[str, np.ndarray]:
    import numpy as np

    return {
        "input_ids": np.full((rows, length), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((rows, length), dtype=np.int64),
        "labels": np.full((rows, length), IGNORE_INDEX, dtype=np.int64),
    }


# --------------------------------------------------------------------------- evaluation and batching


def exact_match_prompts(
    cfg: DataSection, tokenizer: Any, path: str, n: int, *, split: str | None = None
) -> list[tuple[list[int], str]]:
    """The first ``n`` records of ``path`` as (prompt token ids, expected answer) for greedy exact match.

    chat: the conversation before the last assistant turn with the generation prompt -> that turn's content.
    alpaca: the prompt template without the output -> the output. ``split`` defaults to
    ``cfg.eval_split`` or ``cfg.split``.
    """
    if cfg.format == "text":
        raise DataError(
            "exact-match evaluation needs prompts and answers, which data.format text does not have; "
            "use chat or alpaca data, or set train.eval_samples: 0"
        )
    _check_tokenizer(tokenizer, cfg)
    records = load_records(path, split or cfg.eval_split or cfg.split)
    _require_columns(records, cfg, path)
    records = records.select(range(min(max(n, 0), len(records))))
    return [_prompt(record, cfg, tokenizer, f"{path}: record {i}") for i, record in enumerate(records, 1)]


def _prompt(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> tuple[list[int], str]:
    if cfg.format == "alpaca":
        prompt, output = _alpaca_fields(record, where)
        return _bos(tokenizer) + _tokenize(tokenizer, [prompt])[0], output
    messages = _messages(record, cfg, where)
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant turn to use as the expected answer")
    last = turns[-1]
    text = _render(tokenizer, messages[:last], True, where)
    return _tokenize(tokenizer, [text])[0], messages[last]["content"]


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack rows of ``build_dataset`` into LongTensors ``[batch, max_length]``."""
    import torch

    if not rows:
        raise ValueError("collate needs at least one row")
    return {key: torch.stack([torch.as_tensor(row[key], dtype=torch.long) for row in rows]) for key in COLUMNS}
