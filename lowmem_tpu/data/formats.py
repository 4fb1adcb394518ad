"""The formats (text, alpaca, chat): a record becomes (input_ids, labels) of any length.

Labels are not shifted (the model shifts them) and are ``-100`` wherever nothing should be
learned; with ``data.mask_prompt`` that is the prompt (alpaca) or every non-assistant turn (chat).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.data.loading import DataError, load_records

if TYPE_CHECKING:
    import datasets

IGNORE_INDEX = -100
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

# --------------------------------------------------------------------------- checks


def require_columns(records: datasets.Dataset, cfg: DataSection, source: str) -> None:
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


def check_tokenizer(tokenizer: Any, cfg: DataSection) -> None:
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
    check_tokenizer(tokenizer, cfg)
    records = load_records(path, split or cfg.eval_split or cfg.split)
    require_columns(records, cfg, path)
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
