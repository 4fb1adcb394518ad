"""The formats: a record becomes (input_ids, labels) of any length.

text (a text column), alpaca (instruction/input/output), chat (messages), prompt_completion (TRL's
prompt/completion, plain strings or conversational lists of messages) and sharegpt (from/value
turns, read as chat). Labels are not shifted (the model shifts them) and are ``-100`` wherever
nothing should be learned; with ``data.mask_prompt`` that is the prompt (alpaca, prompt_completion)
or every non-assistant turn (chat, sharegpt). ``fields`` reads a record's columns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lowmem_tpu.data.fields as fields
from lowmem_tpu.config import DataSection
from lowmem_tpu.data.chat import assistant_turns, bos_ids, common_prefix, locate, render, served, visible
from lowmem_tpu.data.fields import CHAT_LIKE, require_columns
from lowmem_tpu.data.sources import DataError

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


def check_tokenizer(tokenizer: Any, cfg: DataSection) -> None:
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token: set model.pad_token (padding is masked by position)")
    if cfg.format in CHAT_LIKE and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.format {cfg.format} needs a chat template but the tokenizer has none: set data.chat_template "
            "(plain or chatml, shipped, or a Jinja file) or use data.format alpaca/text"
        )
    if cfg.format not in CHAT_LIKE and tokenizer.eos_token_id is None:
        raise DataError(f"data.format {cfg.format} ends every sample with EOS but the tokenizer has no eos token")


# --------------------------------------------------------------------------- formatting
#
# Each format turns a record into the texts to tokenize, and the token ids of those texts into a
# sample. Texts of many records are tokenized in one call (``encode_records``), not one call each.


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _bos(tokenizer: Any) -> list[int]:
    return list(bos_ids(tokenizer))


def _ended(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` ending with EOS once: a text that already ends with it gets no second one."""
    return ids if ids[-1:] == [tokenizer.eos_token_id] else [*ids, tokenizer.eos_token_id]


def led_by_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """A rendered conversation's ids starting with the BOS the tokenizer puts before every text, as the
    base was pretrained (a template that writes it keeps its own; ``templates`` makes saved ones write it)."""
    bos = _bos(tokenizer)
    return ids if not bos or ids[:1] == bos else bos + ids


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The fixed Alpaca-style prompt (with or without an input) that precedes the output."""
    template = ALPACA_PROMPT if input.strip() else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=instruction, input=input)


def _alpaca_fields(record: dict[str, Any], cfg: DataSection, where: str) -> tuple[str, str]:
    """(prompt text, output) of an alpaca record."""
    instruction = fields.string(record, cfg, "instruction", where)
    extra = fields.string(record, cfg, "input", where)
    return alpaca_prompt(instruction, extra), fields.string(record, cfg, "output", where)


def _prompt_completion(record: dict[str, Any], cfg: DataSection, where: str) -> tuple[Any, Any]:
    """(prompt, completion) of a prompt_completion record: two strings, or two lists of messages."""
    prompt = record.get(fields.column(cfg, "prompt"))
    if fields.is_conversation(prompt) or fields.is_conversation(record.get(fields.column(cfg, "completion"))):
        return fields.messages(record, cfg, "prompt", where), fields.messages(record, cfg, "completion", where)
    return fields.string(record, cfg, "prompt", where), fields.string(record, cfg, "completion", where)


def _need_template(tokenizer: Any, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: a conversational prompt/completion (lists of messages) is rendered with a chat template "
            "and the tokenizer has none: set data.chat_template (plain or chatml, shipped, or a Jinja file)"
        )


def _text_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    return [fields.string(record, cfg, "text", where)]


def _text_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    tokens = _ended(tokenizer, _bos(tokenizer) + ids[0])
    return tokens, list(tokens)


def _alpaca_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    prompt, output = _alpaca_fields(record, cfg, where)
    return [prompt, prompt + output]


def _alpaca_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    """Prompt and answer tokenized as one text, as a user of the trained model will feed it.

    Tokenized apart, a sentencepiece answer would start with the dummy prefix (``▁word`` after a
    newline), a sequence the joined text never produces. The prompt's own tokens are a prefix of
    the joined ones unless its last token merges with the answer's first; the boundary is where
    the two first differ, so a merged token is trained as part of the answer.
    """
    prompt, joined = ids
    boundary = len(_bos(tokenizer)) + common_prefix(prompt, joined)
    tokens = _ended(tokenizer, _bos(tokenizer) + joined)
    labels = [IGNORE_INDEX] * boundary + tokens[boundary:] if cfg.mask_prompt else list(tokens)
    return tokens, labels


def _chat_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    """The whole conversation, then, with mask_prompt, the whole text cut at each assistant turn's start
    and end (``chat.locate``), so whatever the template writes after the content (EOS, newline) is trained."""
    messages = fields.conversation(record, cfg, where)
    whole = served(tokenizer, messages[:-1], messages[-1:], where)  # the last reply as a server asks for it
    cuts = [whole[:at] for turn in assistant_turns(tokenizer, messages, whole, where) for at in (turn.start, turn.end)]
    return [whole, *cuts] if cfg.mask_prompt else [whole]


def _chat_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    """Each turn's tokens are those past where the tokens of the text cut at its start stop matching the
    whole text's, up to where those of the text cut at its end do: a token that joins the prompt's last
    characters to the content is trained, as in alpaca."""
    tokens, *cuts = (led_by_bos(tokenizer, part) for part in ids)
    if not cfg.mask_prompt:
        return tokens, list(tokens)
    labels = [IGNORE_INDEX] * len(tokens)
    for start, end in zip(cuts[::2], cuts[1::2], strict=True):
        first, last = common_prefix(start, tokens), common_prefix(end, tokens)
        labels[first:last] = tokens[first:last]
    return tokens, labels


def _prompt_completion_texts(record: dict[str, Any], cfg: DataSection, tokenizer: Any, where: str) -> list[str]:
    """Plain: the prompt, then prompt and completion joined (as alpaca). Conversational: the whole
    conversation, then (with mask_prompt) the completion's span as chat's pair of renderings: the prompt
    with the generation prompt, and the whole conversation, so every completion message is trained."""
    prompt, completion = _prompt_completion(record, cfg, where)
    if isinstance(prompt, str):
        return [prompt, prompt + completion]
    _need_template(tokenizer, where)
    whole = served(tokenizer, prompt, completion, where)
    start = common_prefix(render(tokenizer, prompt, True, where), whole)
    return [whole, whole[:start], whole] if cfg.mask_prompt else [whole]


def _prompt_completion_sample(ids: list[list[int]], cfg: DataSection, tokenizer: Any, where: str) -> Sample:
    plain = len(ids) == 2  # see _prompt_completion_texts: [prompt, joined] or chat's [whole, start, end]
    return (_alpaca_sample if plain else _chat_sample)(ids, cfg, tokenizer, where)


FORMATS = {
    "text": (_text_texts, _text_sample),
    "alpaca": (_alpaca_texts, _alpaca_sample),
    "chat": (_chat_texts, _chat_sample),
    "sharegpt": (_chat_texts, _chat_sample),
    "prompt_completion": (_prompt_completion_texts, _prompt_completion_sample),
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

    chat, sharegpt: the conversation before the last assistant turn with the generation prompt -> that
    turn's content. alpaca, plain prompt_completion: the tokens before the answer in the joined text (the
    very ones training masks) -> the output. Conversational prompt_completion: the prompt rendered with the
    generation prompt -> the completion's last message.
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
    if cfg.format in ("alpaca", "prompt_completion"):
        prompt, answer = (_alpaca_fields if cfg.format == "alpaca" else _prompt_completion)(record, cfg, where)
        if isinstance(prompt, list):
            _need_template(tokenizer, where)
            return _rendered_answer(tokenizer, prompt, prompt + answer, where)
        ids = _tokenize(tokenizer, [prompt, prompt + answer])
        n = common_prefix(*ids)
        if n < len(ids[0]):  # the prompt's last characters joined the answer's first token: expect them too
            answer = tokenizer.decode(ids[1][n:], skip_special_tokens=True)
        return _bos(tokenizer) + ids[1][:n], answer
    messages = fields.conversation(record, cfg, where)
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant turn to use as the expected answer")
    return _rendered_answer(tokenizer, messages[: turns[-1]], messages[: turns[-1] + 1], where)


def _rendered_answer(
    tokenizer: Any, prompt: list[dict[str, Any]], conversation: list[dict[str, Any]], where: str
) -> tuple[list[int], str]:
    """The prompt with the generation prompt -> what the template writes after it up to the end of the last
    message's content (an empty think block included where the template writes one, as training saw it),
    as a reply is read (``chat.visible``: gpt-oss's final channel, no special token)."""
    text = render(tokenizer, prompt, True, where)
    whole = served(tokenizer, prompt, conversation[len(prompt) :], where)
    turn = locate(tokenizer, conversation, whole, len(conversation) - 1, where)
    answer = visible(tokenizer, whole[turn.start : turn.content_end])
    return led_by_bos(tokenizer, _tokenize(tokenizer, [text])[0]), answer


# --------------------------------------------------------------------------- prompts for generation


def prompt_style(fmt: str | None) -> str | None:
    """How a model trained on ``fmt`` data is prompted: chat (chat, sharegpt), alpaca, or None (raw text:
    text and prompt_completion data, whose prompts are used as they are)."""
    return "chat" if fmt in CHAT_LIKE else "alpaca" if fmt == "alpaca" else None


def generation_prompt(tokenizer: Any, fmt: str | None, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the prompt a model trained on ``fmt`` data expects before its answer.

    chat: the conversation through the tokenizer's chat template with the generation prompt, as
    training rendered it; alpaca: the last message as the Alpaca instruction; otherwise (text and
    plain prompt_completion data, ``--raw``): the last message as it is, after BOS.
    """
    fmt = prompt_style(fmt)
    if fmt == "chat":
        return led_by_bos(tokenizer, _tokenize(tokenizer, [render(tokenizer, messages, True, "the prompt")])[0])
    text = messages[-1]["content"]
    return _bos(tokenizer) + _tokenize(tokenizer, [alpaca_prompt(text) if fmt == "alpaca" else text])[0]
