"""The tokenizer, with a pad token and the model told which ids pad and end text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowmem_tpu.config import ModelSection
from lowmem_tpu.config.features import text_config
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.build import resolve_source


def load_tokenizer(cfg: ModelSection) -> Any:
    """The tokenizer, with a pad token that is not needed to mark the end of text.

    Padding is masked by position in ``data``, so even a pad equal to EOS leaves the
    EOS a trained label; we still prefer a distinct token (``model.pad_token``, else unk).
    """
    from transformers import AutoTokenizer

    source = resolve_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, use_fast=cfg.use_fast_tokenizer, revision=cfg.revision)
    except (OSError, ValueError, ImportError) as err:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source!r}: {_why(err)}") from None
    if tokenizer.pad_token is None or cfg.pad_token:
        choice = cfg.pad_token or tokenizer.unk_token or tokenizer.eos_token
        if choice is None or choice not in tokenizer.get_vocab():
            raise UserError(
                f"model.pad_token: {choice!r} is not a token of this tokenizer; name one it has, or set "
                "model.pad_token: null to use the tokenizer's own pad token (else its unk, else its eos)"
            )
        tokenizer.pad_token = choice
    tokenizer.padding_side = "right"
    return tokenizer


# What transformers 5.24 needs to read a sentencepiece tokenizer.model: sentencepiece for the slow
# tokenizer, protobuf to convert it into a fast one. Without protobuf it falls back to tiktoken and
# fails with "`tiktoken` is required to read a `tiktoken` file", which names the wrong package.
SENTENCEPIECE_NEEDS = {"google.protobuf": "protobuf", "sentencepiece": "sentencepiece"}


def _why(err: Exception) -> str:
    import importlib.util

    missing = [name for module, name in SENTENCEPIECE_NEEDS.items() if importlib.util.find_spec(module) is None]
    if missing:
        names = " and ".join(missing)
        return (
            f"reading a sentencepiece tokenizer.model needs {names}, which is not installed: "
            f"pip install {' '.join(missing)} (the pinned set, make install, has it); the loader said: {err}"
        )
    return str(err)


def check_vocabulary(tokenizer: Any, config: Any) -> None:
    """Refuse token ids the model's embedding has no row for, before any weight is placed.

    On XLA an out-of-range row is gathered silently (eager PyTorch raises), so the model would train
    on garbage with a plausible-looking loss.
    """
    rows = getattr(text_config(config), "vocab_size", None)  # a multimodal model's: its text decoder's
    if rows is None:
        return
    fix = "use the model's own tokenizer (model.tokenizer) or a model whose embedding has a row for every token"
    if len(tokenizer) > rows:
        raise UserError(
            f"model.tokenizer: the tokenizer has {len(tokenizer):,} tokens but the model's embedding has {rows:,} "
            f"rows, so ids {rows:,}-{len(tokenizer) - 1:,} would read garbage; {fix}"
        )
    for name in ("pad", "eos", "bos"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None and not 0 <= token_id < rows:
            field = "model.pad_token" if name == "pad" else "model.tokenizer"
            raise UserError(f"{field}: the {name} token's id {token_id} is outside the {rows:,} embedding rows; {fix}")


def align_special_tokens(model: Any, tokenizer: Any) -> None:
    """Tell the model config which ids the tokenizer pads and ends with.

    The tokenizer's EOS comes first; every other end id the model lists is kept (Llama 3's end of turn
    and end of message, Gemma's end of turn), so what it saves stops where the base stops.
    """
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None:
            config.pad_token_id = tokenizer.pad_token_id
            config.eos_token_id = end_ids(tokenizer.eos_token_id, config.eos_token_id)


def end_ids(first: int | None, listed: int | list[int] | None) -> int | list[int] | None:
    """``first`` followed by the other ids of ``listed``: one id stays an int, several a list."""
    others = listed if isinstance(listed, list) else [listed]
    ids = list(dict.fromkeys(i for i in (first, *others) if i is not None))
    return ids[0] if len(ids) == 1 else (ids or None)


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """``save_pretrained``, plus the files transformers 5 no longer writes that other tools read.

    transformers 5 saves tokenizer.json, tokenizer_config.json and chat_template.jinja only. The base's
    sentencepiece ``tokenizer.model`` (read by slow tokenizers, sentencepiece itself and llama.cpp's
    converter) is copied as it is, and ``special_tokens_map.json`` is written from the tokenizer's own
    special tokens (pad included), so the directory loads wherever the base does.
    """
    import json
    import shutil

    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    source = Path(getattr(tokenizer, "vocab_file", None) or "")
    if source.suffix == ".model" and source.is_file() and not (directory / source.name).exists():
        shutil.copy2(source, directory / source.name)
    special = directory / "special_tokens_map.json"
    if not special.exists():
        special.write_text(json.dumps(dict(tokenizer.special_tokens_map), indent=2) + "\n")
