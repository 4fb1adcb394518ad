"""Chat templates for tokenizers that have none (Open Llama): shipped ones by name, or a Jinja file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.config.assets import CHAT_TEMPLATES, chat_template_names
from lowmem_tpu.data.chat import bos_ids
from lowmem_tpu.data.sources import DataError


def template_text(value: str) -> str:
    """The Jinja source of a shipped template (``plain``, ``chatml``) or of a template file."""
    if value in chat_template_names():
        return (CHAT_TEMPLATES / f"{value}.jinja").read_text()
    path = Path(value).expanduser()
    try:
        return path.read_text()
    except OSError as err:
        names = ", ".join(chat_template_names())
        message = f"data.chat_template: cannot read {value!r} ({err}); name a shipped one ({names}) or a file"
        raise DataError(message) from None


def set_chat_template(tokenizer: Any, cfg: DataSection) -> str | None:
    """Give the tokenizer ``data.chat_template``; for chat, ShareGPT or preference data (often conversations)
    without one, the shipped plain one.

    Returns a line saying what was chosen (None when the tokenizer's own template is used as it is). The
    template is saved with the tokenizer in ``final/``, so generation and serving render prompts exactly as
    training did: a template that does not write the BOS the tokenizer puts before every text (chatml, the
    plain one) is made to write it, since every training row starts with it.
    """
    said = None
    if cfg.chat_template:
        tokenizer.chat_template = template_text(cfg.chat_template)
        said = f"chat template: {cfg.chat_template}"
    elif cfg.format in ("chat", "sharegpt", "preference") and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template_text("plain")
        said = "the tokenizer has no chat template: using the shipped plain one (data.chat_template chooses another)"
    if isinstance(getattr(tokenizer, "chat_template", None), str) and not _writes_bos(tokenizer):
        tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
        said = (said or "chat template: the tokenizer's own") + ", with the BOS every training row starts with"
    return said


def _writes_bos(tokenizer: Any) -> bool:
    """Whether the template starts with the BOS the tokenizer puts before a text (or there is none to write)."""
    if not bos_ids(tokenizer):
        return True
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception:  # a template that refuses this probe is checked on the real data instead
        return True
    return isinstance(text, str) and text.startswith(tokenizer.bos_token)
