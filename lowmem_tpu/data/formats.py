"""The formats (text, alpaca, chat): a record becomes (input_ids, labels) of any length.

Labels are not shifted (the model shifts them) and are ``-100`` wherever nothing should be
learned; with ``data.mask_prompt`` that is the prompt (alpaca) or every non-assistant turn (chat).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.data.loading import DataError

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
            "data.format chat needs a chat template but the tokenizer has none: set data.chat_template "
            "(plain or chatml, shipped, or a Jinja file) or use data.format alpaca/text"
        )
    if cfg.format != "chat" and tokenizer.eos_token_id is None:
        raise DataError(f"data.format {cfg.format} ends every sample with EOS but the tokenizer has no eos token")


# --------------------------------------------------------------------------- formatting
#
# Each format turns a record into the texts to tokenize, and the token ids of those texts into a
# sample. Texts of many records are tokenized in one call (``encode_records``), not one call each.


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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # a template is user code: jinja errors, raise_exception(), KeyError...
        raise DataError(f"{where}: the chat template failed on this conversation: {err}") from err


def _text_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    return [_string(record, cfg.text_field, where, "data.text_field")]


def _text_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    tokens = _bos(tokenizer) + ids[0] + [tokenizer.eos_token_id]
    return tokens, list(tokens)


def _alpaca_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    prompt, output = _alpaca_fields(record, where)
    return [prompt, prompt + output]


def _alpaca_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    """Prompt and answer tokenized as one text, as a user of the trained model will feed it.

    Tokenized apart, a sentencepiece answer would start with the dummy prefix (``▁word`` after a
    newline), a sequence the joined text never produces. The prompt's own tokens are a prefix of
    the joined ones unless its last token merges with the answer's first; the boundary is where
    the two first differ, so a merged token is trained as part of the answer.
    """
    prompt, joined = ids
    boundary = len(_bos(tokenizer)) + _common_prefix(prompt, joined)
    tokens = _bos(tokenizer) + joined + [tokenizer.eos_token_id]
    labels = [IGNORE_INDEX] * boundary + tokens[boundary:] if cfg.mask_prompt else list(tokens)
    return tokens, labels


def _chat_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    """The whole conversation, then, with mask_prompt, each assistant turn's start and end renderings.

    An assistant turn spans from the end of the conversation before it rendered with the generation
    prompt to the end of the conversation including it, so whatever the template appends after the
    content (EOS, newline) is trained too.
    """
    messages = _messages(record, cfg, where)
    texts = [_render(tokenizer, messages, False, where)]
    if cfg.mask_prompt:
        for i in (i for i, message in enumerate(messages) if message["role"] == "assistant"):
            texts += [
                _render(tokenizer, messages[:i], True, where),
                _render(tokenizer, messages[: i + 1], False, where),
            ]
    return texts


def _chat_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    tokens, *prefixes = ids
    if not cfg.mask_prompt:
        return tokens, list(tokens)
    if any(tokens[: len(prefix)] != prefix for prefix in prefixes):
        raise DataError(
            f"{where}: the chat template is not prefix-stable (a conversation rendered up to a turn does not "
            "tokenize to a prefix of the whole one), so the assistant turns cannot be located; "
            "set data.mask_prompt: false to train on every token"
        )
    labels = [IGNORE_INDEX] * len(tokens)
    for start, end in zip(prefixes[::2], prefixes[1::2], strict=True):
        labels[len(start) : len(end)] = tokens[len(start) : len(end)]
    return tokens, labels


FORMATS = {
    "text": (_text_texts, _text_sample),
    "alpaca": (_alpaca_texts, _alpaca_sample),
    "chat": (_chat_texts, _chat_sample),
}
BATCH = 1000  # records tokenized per tokenizer call


def encode_records(records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str) -> Iterator[Sample]:
    """(input_ids, labels) of every record, as int32 arrays, tokenizing ``BATCH`` records per call."""
    import numpy as np

    texts_of, sample_of = FORMATS[cfg.format]
    for start in range(0, len(records), BATCH):
        chunk = records.select(range(start, min(start + BATCH, len(records))))
        where = [f"{source}: record {start + i}" for i in range(1, len(chunk) + 1)]
        texts = [texts_of(record, cfg, tokenizer, w) for record, w in zip(chunk, where, strict=True)]
        flat = _tokenize(tokenizer, [text for group in texts for text in group])
        offset = 0
        for group, w in zip(texts, where, strict=True):
            ids, offset = flat[offset : offset + len(group)], offset + len(group)
            yield tuple(np.asarray(part, dtype=np.int32) for part in sample_of(ids, cfg, tokenizer, w))


# --------------------------------------------------------------------------- exact-match prompts


def prompt_answer_pairs(
    records: datasets.Dataset, cfg: DataSection, tokenizer: Any, source: str, n: int
) -> list[tuple[list[int], str]]:
    """The first ``n`` records as (prompt token ids, expected answer) for greedy exact match.

    chat: the conversation before the last assistant turn with the generation prompt -> that turn's content.
    alpaca: the tokens before the answer in the joined text (the very ones training masks) -> the output.
    """
    if cfg.format == "text":
        raise DataError(
            "exact-match evaluation needs prompts and answers, which data.format text does not have; "
            "use chat or alpaca data, or set train.eval_samples: 0"
        )
    check_tokenizer(tokenizer, cfg)
    require_columns(records, cfg, source)
    records = records.select(range(min(max(n, 0), len(records))))
    return [_prompt(record, cfg, tokenizer, f"{source}: record {i}") for i, record in enumerate(records, 1)]


def _prompt(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> tuple[list[int], str]:
    if cfg.format == "alpaca":
        prompt, output = _alpaca_fields(record, where)
        ids = _tokenize(tokenizer, [prompt, prompt + output])
        boundary = len(_bos(tokenizer)) + _common_prefix(*ids)
        return (_bos(tokenizer) + ids[1])[:boundary], output
    messages = _messages(record, cfg, where)
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant turn to use as the expected answer")
    last = turns[-1]
    text = _render(tokenizer, messages[:last], True, where)
    return _tokenize(tokenizer, [text])[0], messages[last]["content"]


# --------------------------------------------------------------------------- prompts for generation


def generation_prompt(tokenizer: Any, fmt: str | None, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the prompt a model trained on ``fmt`` data expects before its answer.

    chat: the conversation through the tokenizer's chat template with the generation prompt, as
    training rendered it; alpaca: the last message as the Alpaca instruction; otherwise (text data,
    ``--raw``): the last message as it is, after BOS.
    """
    if fmt == "chat":
        return _tokenize(tokenizer, [_render(tokenizer, messages, True, "the prompt")])[0]
    text = messages[-1]["content"]
    return _bos(tokenizer) + _tokenize(tokenizer, [alpaca_prompt(text) if fmt == "alpaca" else text])[0]
