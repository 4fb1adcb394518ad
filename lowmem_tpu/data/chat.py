"""Conversations as a chat template renders them: where each assistant turn lies, and how a reply ends.

Templates render a turn differently depending on what follows it (Qwen 3 writes an empty think block
only in the turns after the last user message; Phi-3 writes EOS after the last message only), so a
turn is located in the whole conversation, not by rendering prefixes: it starts where the
conversation before it, rendered with the generation prompt, stops matching the whole one (the last reply
follows the generation prompt as a server sends it: ``served``); its
content is found from there; it ends after the text the template writes after the content
(``<|eot_id|>``, ``<|im_end|>\\n``, ``<end_of_turn>\\n``, ``<|end|>\\n``), as far as the whole
conversation has it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lowmem_tpu.data.sources import DataError

PROBE = "lowmem-probe-reply"  # assistant content that no template writes on its own


@dataclass(frozen=True)
class Turn:
    """An assistant turn in a rendered conversation, as character offsets."""

    start: int  # where the model's part begins: after the generation prompt
    content_end: int  # the end of the message's content
    end: int  # after the template's end of turn


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # a template is user code: jinja errors, raise_exception(), KeyError...
        raise DataError(f"{where}: the chat template failed on this conversation: {err}") from err


def common_prefix(a: Any, b: Any) -> int:
    """How many leading items (characters, token ids) ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def served(tokenizer: Any, prompt: list[dict[str, Any]], reply: list[dict[str, Any]], where: str) -> str:
    """``prompt + reply`` rendered, the reply after the generation prompt as a server sends it: a template
    whose generation prompt writes what its rendered history does not, right where the reply begins
    (Gemma 4's empty thinking channel, ``<|channel>thought\n<channel|>``), is trained on what it will be
    asked with. Otherwise (every other family) the whole conversation as the template renders it."""
    whole = render(tokenizer, prompt + reply, False, where)
    replying = prompt and reply and reply[0].get("role") == "assistant"
    content = str(reply[0].get("content") or "").strip() if replying else ""
    if not content:
        return whole
    text = render(tokenizer, prompt, True, where)
    start = common_prefix(text, whole)
    return text + whole[start:] if start < len(text) and whole[start:].startswith(content) else whole


def locate(tokenizer: Any, messages: list[dict[str, Any]], whole: str, index: int, where: str) -> Turn:
    """Where assistant message ``index`` lies in ``whole``, the rendered conversation that contains it."""
    prompt = render(tokenizer, messages[:index], True, where) if index else ""  # a template may refuse no messages
    start = common_prefix(prompt, whole)
    content = str(messages[index].get("content") or "").strip()
    at = whole.find(content, start) if content else -1
    if at < 0:
        raise DataError(
            f"{where}: assistant message {index + 1} is empty or the chat template does not write its content "
            "as it is, so the turn cannot be located; fix the record, or set data.mask_prompt: false to train "
            "on every token"
        )
    if start < len(prompt) or not index:  # earlier turns rendered differently here, or none: train the content on
        start = at
    content_end = at + len(content)
    alone = render(tokenizer, messages[: index + 1], False, where)
    suffix = alone[alone.rfind(content) + len(content) :]
    return Turn(start, content_end, content_end + common_prefix(suffix, whole[content_end:]))


def assistant_turns(tokenizer: Any, messages: list[dict[str, Any]], whole: str, where: str) -> list[Turn]:
    """Every assistant turn of ``messages``, located in ``whole``."""
    indices = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    return [locate(tokenizer, messages, whole, i, where) for i in indices]


HARMONY_FINAL = "<|channel|>final<|message|>"  # gpt-oss: what follows is the reply a user reads


def visible(tokenizer: Any, text: str) -> str:
    """A reply's text as a user reads it: of a harmony reply (gpt-oss: analysis, then the final channel) the
    final channel's, and no special token."""
    text = text.rsplit(HARMONY_FINAL, 1)[-1]
    for token in (t.content for t in tokenizer.added_tokens_decoder.values() if t.special):
        text = text.replace(token, "")
    return text


def reply_text(tokenizer: Any, ids: list[int]) -> str:
    """Generated ids as the reply's text (``visible``); without harmony's channels, as decoding skips the
    special tokens."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return visible(tokenizer, text) if HARMONY_FINAL in text else tokenizer.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=16)
def bos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The BOS the tokenizer itself puts before a text (Llama, Gemma, Mistral), or nothing (Qwen, Phi-3)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return ()
    return (bos,) if list(tokenizer("a")["input_ids"][:1]) == [bos] else ()


@dataclass(frozen=True)
class Ending:
    """How a reply ends: the ids that stop decoding, and end-of-turn text that is not one special token."""

    ids: tuple[int, ...]
    text: str = ""

    def cut(self, ids: list[int]) -> list[int]:
        """``ids`` up to the first id that ends a reply."""
        stops = [i for i, token in enumerate(ids) if token in self.ids]
        return ids[: stops[0]] if stops else ids

    def clean(self, reply: str) -> str:
        """``reply`` without the end-of-turn text a tokenizer spells in several tokens (chatml on Open Llama)."""
        return reply.split(self.text, 1)[0] if self.text else reply


def ending(tokenizer: Any, model: Any = None) -> Ending:
    """The tokenizer's EOS, every end id the model's generation config lists, and the template's end of turn.

    The end of turn is what the template writes after an assistant message: its first token stops
    decoding when it is a special token; otherwise the text is cut from replies.
    """
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [i for i in (tokenizer.eos_token_id, *(listed if isinstance(listed, list) else [listed])) if i is not None]
    text = ""
    if getattr(tokenizer, "chat_template", None):
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}]
        try:
            rendered = render(tokenizer, probe, False, "")
        except DataError:
            rendered = ""
        suffix = rendered[rendered.rfind(PROBE) + len(PROBE) :] if PROBE in rendered else ""
        suffix_ids = list(tokenizer(suffix, add_special_tokens=False)["input_ids"]) if suffix.strip() else []
        if suffix_ids and suffix_ids[0] in set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder):
            ids.append(suffix_ids[0])
        text = tokenizer.decode(suffix_ids, skip_special_tokens=True).strip()
    return Ending(tuple(dict.fromkeys(ids)), text)
