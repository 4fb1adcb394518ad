"""The tokenizer, with a pad token and the model told which ids pad and end text."""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config import ModelSection
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.loading import resolve_source


def load_tokenizer(cfg: ModelSection) -> Any:
    """The tokenizer, with a pad token that is not needed to mark the end of text.

    Padding is masked by position in ``data``, so even a pad equal to EOS leaves the
    EOS a trained label; we still prefer a distinct token (``model.pad_token``, else unk).
    """
    from transformers import AutoTokenizer

    source = resolve_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, use_fast=cfg.use_fast_tokenizer, revision=cfg.revision)
    except (OSError, ValueError) as err:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source!r}: {err}") from None
    if tokenizer.pad_token is None or cfg.pad_token:
        choice = cfg.pad_token or tokenizer.unk_token or tokenizer.eos_token
        if choice is None or choice not in tokenizer.get_vocab():
            raise UserError(f"model.pad_token: {choice!r} is not a token of this tokenizer; name one it has")
        tokenizer.pad_token = choice
    tokenizer.padding_side = "right"
    return tokenizer


def align_special_tokens(model: Any, tokenizer: Any) -> None:
    """Tell the model config which ids the tokenizer pads and ends with."""
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None:
            config.pad_token_id = tokenizer.pad_token_id
            config.eos_token_id = tokenizer.eos_token_id
