"""A tokenizer as GGUF metadata: the vocabulary llama.cpp tokenizes with, in one of its two kinds.

- **Sentencepiece** (``tokenizer.ggml.model = llama``; Llama 2, Open Llama, Mistral, Gemma, Phi-3): pieces,
  scores and piece types. From ``tokenizer.model`` when the directory has it (the scores sentencepiece
  trained); from a ``tokenizer.json`` BPE in sentencepiece style otherwise, where a piece's score is minus
  the rank of the merge that makes it, so that llama.cpp, which merges the best-scored pair first, merges
  in the order the BPE does.
- **Byte-level BPE** (``gpt2``; Llama 3, Qwen, Phi-4): tokens in the byte alphabet, the merges, and the
  pre-tokenizer, named by llama.cpp's names for the split patterns it knows.

A character vocabulary (the demo's tokenizer: one token per character, no merges, no pre-tokenizer) is
written as sentencepiece with its space token spelled ``▁`` and no space put before a text. Anything else
is refused, naming what the tokenizer is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_tpu.errors import UserError

SPACE = "\u2581"
# llama.cpp's piece types (llama_token_type): what a token is when it tokenizes and detokenizes.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Split patterns of byte-level tokenizers, by the name llama.cpp gives the pre-tokenizer that uses them.
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CASED = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PRE_TOKENIZERS = {
    "llama-bpe": _LETTERS + r"\p{N}{1,3}|" + _REST,
    "qwen2": _LETTERS + r"\p{N}|" + _REST,
    "gpt-4o": rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_CASED}+{_SUFFIX}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_CASED}*{_SUFFIX}|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GPT2_PRE = "gpt-2"  # a ByteLevel pre-tokenizer with its own (GPT-2) split pattern


@dataclass
class Vocab:
    """What goes under ``tokenizer.ggml.*``."""

    model: str  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    add_space_prefix: bool | None = None
    kind: str = ""  # for the report: where the vocabulary came from


def read_vocab(directory: Path, tokenizer: Any, vocab_size: int) -> Vocab:
    """The GGUF vocabulary of ``tokenizer`` (saved in ``directory``), padded to the model's ``vocab_size`` rows."""
    spm = directory / "tokenizer.model"
    spec = _tokenizer_json(directory)
    model = (spec or {}).get("model", {})
    if spm.is_file() and not _byte_level(spec):
        vocab = _from_sentencepiece(spm, tokenizer)
    elif spec is None:
        raise UserError(f"{directory} has neither tokenizer.json nor tokenizer.model; GGUF needs the vocabulary")
    elif model.get("type") != "BPE":
        raise UserError(
            f"the tokenizer in {directory} is a {model.get('type')} model; GGUF export writes BPE and "
            "sentencepiece vocabularies only"
        )
    elif _byte_level(spec):
        vocab = _from_byte_level(spec, tokenizer)
    else:
        vocab = _from_bpe_pieces(spec, tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(unk, int) and unk < len(vocab.types):
        vocab.types[unk] = UNKNOWN  # llama.cpp's fallback piece, though the tokenizer lists it among its specials
    return _padded(vocab, vocab_size, directory)


def _tokenizer_json(directory: Path) -> dict[str, Any] | None:
    path = directory / "tokenizer.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _walk(part: Any) -> list[dict[str, Any]]:
    """A tokenizer.json component and, for a Sequence, its members."""
    if not isinstance(part, dict):
        return []
    members = part.get("pretokenizers") or part.get("normalizers") or part.get("decoders") or []
    return [part] + [m for member in members for m in _walk(member)]


def _byte_level(spec: dict[str, Any] | None) -> bool:
    parts = _walk((spec or {}).get("pre_tokenizer")) + _walk((spec or {}).get("decoder"))
    return any(p.get("type") == "ByteLevel" for p in parts)


def _added(tokenizer: Any) -> dict[int, Any]:
    return dict(tokenizer.added_tokens_decoder)


def _added_type(token: Any) -> int:
    return CONTROL if token.special else USER_DEFINED


def _from_sentencepiece(path: Path, tokenizer: Any) -> Vocab:
    from sentencepiece import SentencePieceProcessor, sentencepiece_model_pb2

    sp = SentencePieceProcessor(model_file=str(path))
    tokens, types, scores = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(
            UNKNOWN
            if sp.is_unknown(i)
            else CONTROL
            if sp.is_control(i)
            else UNUSED
            if sp.is_unused(i)
            else BYTE
            if sp.is_byte(i)
            else NORMAL
        )
    for i, token in sorted(_added(tokenizer).items()):
        if i < len(tokens):  # a piece the tokenizer matches whole, as it spells it (llama.cpp does the same)
            if types[i] not in (UNKNOWN, BYTE):
                tokens[i], types[i] = token.content, _added_type(token)
            continue
        while len(tokens) < i:  # a hole in the added ids: llama.cpp needs every id
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(UNUSED)
            scores.append(-1000.0)
        tokens.append(token.content)
        types.append(_added_type(token))
        scores.append(-1000.0)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return Vocab(
        "llama",
        tokens,
        types,
        scores,
        add_space_prefix=proto.normalizer_spec.add_dummy_prefix,
        kind="sentencepiece (tokenizer.model)",
    )


def _id_ordered(vocab: dict[str, int], tokenizer: Any) -> tuple[list[str | None], list[int]]:
    size = max([*vocab.values(), *_added(tokenizer)], default=-1) + 1
    tokens: list[str | None] = [None] * size
    types = [NORMAL] * size
    for token, i in vocab.items():
        tokens[i] = token
    for i, token in _added(tokenizer).items():
        tokens[i] = token.content
        types[i] = _added_type(token)
    return tokens, types


def _fill_holes(tokens: list[str | None], types: list[int]) -> list[str]:
    for i, token in enumerate(tokens):
        if token is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = UNUSED
    return tokens  # type: ignore[return-value]


def _merge_pairs(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def _from_byte_level(spec: dict[str, Any], tokenizer: Any) -> Vocab:
    model = spec["model"]
    tokens, types = _id_ordered(model["vocab"], tokenizer)
    merges = [f"{a} {b}" for a, b in _merge_pairs(model)]
    return Vocab(
        "gpt2",
        _fill_holes(tokens, types),
        types,
        merges=merges,
        pre=_pre_tokenizer(spec),
        kind="byte-level BPE (tokenizer.json)",
    )


def _pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for this tokenizer's split pattern; an unknown pattern is refused, not guessed."""
    patterns = [p["pattern"].get("Regex") for p in _walk(spec.get("pre_tokenizer")) if p.get("type") == "Split"]
    if not patterns:
        levels = [p for p in _walk(spec.get("pre_tokenizer")) if p.get("type") == "ByteLevel"]
        if levels and levels[0].get("use_regex", True):
            return GPT2_PRE
    for name, regex in PRE_TOKENIZERS.items():
        if regex in patterns:
            return name
    raise UserError(
        "the tokenizer splits text with a pattern llama.cpp has no name for "
        f"({(patterns or ['none'])[0][:60]!r}...); a GGUF would tokenize differently, so none was written. "
        f"Known patterns: {', '.join(PRE_TOKENIZERS)}, and GPT-2's"
    )


def _from_bpe_pieces(spec: dict[str, Any], tokenizer: Any) -> Vocab:
    """A tokenizer.json BPE that is sentencepiece in style (``▁`` word marks), or a character vocabulary."""
    model = spec["model"]
    merges = _merge_pairs(model)
    sentencepiece_style = any(
        p.get("type") in ("Metaspace", "Replace")
        for p in _walk(spec.get("pre_tokenizer")) + _walk(spec.get("normalizer"))
    )
    if not sentencepiece_style:
        return _from_characters(model, merges, tokenizer)
    tokens, types = _id_ordered(model["vocab"], tokenizer)
    rank: dict[str, float] = {}
    for i, (a, b) in enumerate(merges):
        rank.setdefault(a + b, -float(i))  # the first merge that makes a piece is the one BPE applies
    unmade = -float(len(merges))  # single characters and pieces no merge makes: below every merge
    scores = [rank.get(t or "", unmade) if types[i] == NORMAL else -1000.0 for i, t in enumerate(tokens)]
    for i, token in enumerate(tokens):
        if token is not None and types[i] == NORMAL:
            types[i] = BYTE if _is_byte(token) else UNKNOWN if token == model.get("unk_token") else NORMAL
    return Vocab(
        "llama",
        _fill_holes(tokens, types),
        types,
        scores,
        add_space_prefix=_prepends_space(spec),
        kind="sentencepiece-style BPE (tokenizer.json)",
    )


def _is_byte(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def _from_characters(model: dict[str, Any], merges: list[tuple[str, str]], tokenizer: Any) -> Vocab:
    """One token per character and nothing merged: sentencepiece's kind splits text into the same characters
    when the space token is spelled ``▁`` and no space is put before the text. (The byte-level kind would
    need at least one merge, and a GGUF array may not be empty.)"""
    added = _added(tokenizer)
    if merges or any(len(t) > 1 for t, i in model["vocab"].items() if i not in added):
        raise UserError(
            "the tokenizer is a BPE without byte-level or sentencepiece-style word marks; "
            "llama.cpp has no tokenizer that splits text as it does, so no GGUF was written"
        )
    tokens, types = _id_ordered(model["vocab"], tokenizer)
    for i, token in enumerate(tokens):
        if token is not None and i not in added:
            tokens[i] = token.replace(" ", SPACE)
            types[i] = UNKNOWN if token == model.get("unk_token") else NORMAL
    scores = [0.0 if t == NORMAL else -1000.0 for t in types]
    return Vocab(
        "llama", _fill_holes(tokens, types), types, scores, add_space_prefix=False, kind="characters (tokenizer.json)"
    )


def _prepends_space(spec: dict[str, Any]) -> bool:
    parts = _walk(spec.get("pre_tokenizer")) + _walk(spec.get("normalizer"))
    for p in parts:
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always") != "never" and p.get("add_prefix_space", True)
        if p.get("type") == "Prepend" and p.get("prepend") == SPACE:
            return True
    return False


def _padded(vocab: Vocab, vocab_size: int, directory: Path) -> Vocab:
    """llama.cpp reads one token per embedding row: rows past the tokenizer get unused fillers."""
    if len(vocab.tokens) > vocab_size:
        raise UserError(
            f"the tokenizer in {directory} has {len(vocab.tokens)} tokens but the model {vocab_size} embedding "
            "rows; the tokenizer does not belong to this model"
        )
    for i in range(len(vocab.tokens), vocab_size):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)
    return vocab


def special_ids(tokenizer: Any, config: Any) -> dict[str, int]:
    """BOS, EOS, UNK and PAD ids: the tokenizer's, else the model config's first EOS."""
    ids: dict[str, int] = {}
    for name in ("bos", "eos", "unk", "pad"):
        value = getattr(tokenizer, f"{name}_token_id", None)
        if value is None:
            value = getattr(config, f"{name}_token_id", None)
            value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            ids[name] = value
    return ids
