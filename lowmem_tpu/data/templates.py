"""Chat templates for tokenizers that have none (Open Llama): shipped ones by name, or a Jinja file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowmem_tpu.config import DataSection
from lowmem_tpu.config.assets import CHAT_TEMPLATES, chat_template_names
from lowmem_tpu.data.loading import DataError


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
    """Give the tokenizer ``data.chat_template``; for chat (or ShareGPT) data without one, the shipped plain one.

    Returns a line saying what was chosen (None when the tokenizer's own template is used). The template
    is saved with the tokenizer in ``final/``, so generation renders prompts exactly as training did.
    """
    if cfg.chat_template:
        tokenizer.chat_template = template_text(cfg.chat_template)
        return f"chat template: {cfg.chat_template}"
    if cfg.format in ("chat", "sharegpt") and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template_text("plain")
        return "the tokenizer has no chat template: using the shipped plain one (data.chat_template chooses another)"
    return None
