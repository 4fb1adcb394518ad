"""A GGUF file read back by the programs that run it: transformers (``gguf_file=``) and llama.cpp where installed.

Each reader's logits on the merge check's prompts must be within the type's tolerance of the model's.
llama.cpp's token ids for the plain check texts must equal the model tokenizer's: llama.cpp is what serves
the file. Its ids for a chat-rendered text, and transformers' ids, are reported beside: llama.cpp puts a
space before text that follows a special token in a sentencepiece vocabulary with a space prefix, and
transformers' GGUF tokenizer reader drops some settings a file states, so a difference there is a figure
to read, not a failed export.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from lowmem_tpu.publish.gguf import llama_cpp
from lowmem_tpu.publish.gguf.metadata import adds_bos
from lowmem_tpu.publish.verify import PROMPTS, compare, logits

# max |GGUF - model| / max |model| over the check prompts' logits. transformers dequantizes the file and
# computes in float32: a float32 file differs by summation order; f16 and bf16 by each weight's rounding
# (10 and 7 mantissa bits); Q8_0 by 8-bit blocks of 32. llama.cpp computes with its own kernels (the check
# loads it with a float32 KV cache: its float16 default moved Gemma 4's stand-in by 1e-2) and, for Q8_0, 8-bit
# activations, so it is allowed more. Q8_0 measured 0.01-0.03 on the random
# stand-ins and 0.15 on the demo's trained model (its merged adapters are large next to its random base);
# a tensor written under the wrong name or layout moves the logits by 0.5 and more and the top token
# with them, so Q8_0 must also keep the model's top token at nearly every position.
TOLERANCE = {
    "transformers": {"f32": 1e-5, "f16": 2e-2, "bf16": 5e-2, "q8_0": 0.25},
    "llama.cpp": {"f32": 1e-2, "f16": 3e-2, "bf16": 5e-2, "q8_0": 0.3},
}
QUANTIZED_TOP1 = 0.9
CHAT = [{"role": "user", "content": "reverse abcde"}, {"role": "assistant", "content": "edcba"}]


def check_file(
    directory: Path, name: str, rows: list[Any], reference: list[Any], tokenizer: Any, qtype: str, config: Any
) -> dict[str, dict[str, Any]]:
    """Per reader: the logits figures, token ids, and ``passed``."""
    texts = _covered(tokenizer, list(PROMPTS))
    chat = _chat_text(tokenizer)
    readers: dict[str, dict[str, Any]] = {}
    if transformers_reads(config):
        readers["transformers"] = _transformers(directory, name, rows, reference, tokenizer, qtype, config)
        readers["transformers"].update(_ids_or_not(directory, name, tokenizer, texts, chat))
        readers["transformers"]["passed"] = readers["transformers"]["logits_passed"]
    if llama_cpp.available():
        runner = llama_cpp.load(directory / name, max(row.shape[1] for row in rows))
        figures = _judged(compare(reference, llama_cpp.logits(runner, rows), "float32"), "llama.cpp", qtype)
        bos = adds_bos(tokenizer)
        figures.update(_ids(lambda text: llama_cpp.tokenize(runner, text, bos), tokenizer, texts, chat))
        figures["passed"] = figures["logits_passed"] and figures["token_ids"] == f"{len(texts)}/{len(texts)}"
        readers["llama.cpp"] = figures
        runner.close()
    return readers


# Architectures transformers' GGUF reader cannot build a model from (Gemma 4's per-layer arrays fail its
# config's validation; gpt-oss's experts are not where it looks): llama.cpp alone checks those files.
UNREAD_BY_TRANSFORMERS = {
    "gemma4_text": "its GGUF reader takes no per-layer arrays (KV heads, MLP widths)",
    "gpt_oss": "its GGUF reader looks for per-expert tensors under other names than llama.cpp's",
}


def transformers_reads(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.model_type not in UNREAD_BY_TRANSFORMERS


def _transformers(
    directory: Path, name: str, rows: list[Any], reference: list[Any], tokenizer: Any, qtype: str, config: Any
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, config=_reader_config(directory, name, config), dtype="float32"
    ).eval()
    figures = _judged(compare(reference, logits(model, rows), "float32"), "transformers", qtype)
    del model
    gc.collect()
    return figures


def _ids_or_not(directory: Path, name: str, tokenizer: Any, texts: list[str], chat: str) -> dict[str, str]:
    read = _transformers_tokenizer(directory, name)
    return _ids(read, tokenizer, texts, chat) if read else {"token_ids": _NOT_READ}


_NOT_READ = "not compared: transformers' GGUF reader puts a space before every text (the file says none)"


def _reader_config(directory: Path, name: str, source_config: Any) -> Any:
    """transformers' config for the file, with the fields its GGUF reader does not map (rotary scaling, head
    size, windows, soft-caps) taken from the model's own: transformers checks the tensors, llama.cpp the
    metadata. A field the file's architecture has no place for (Mistral's window under LLAMA) stays out."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    text = source_config.get_text_config() if hasattr(source_config, "get_text_config") else source_config
    for key, value in text.to_dict().items():
        if key not in ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version") and hasattr(
            config, key
        ):
            setattr(config, key, value)
    return config


def _judged(check: dict[str, Any], reader: str, qtype: str) -> dict[str, Any]:
    keep = ("relative_diff", "max_abs_diff", "max_abs_logit", "top1_agreement", "tokens")
    out = {key: check[key] for key in keep}
    out["tolerance"] = TOLERANCE[reader][qtype]
    top1 = QUANTIZED_TOP1 if qtype == "q8_0" else 0.0
    out["logits_passed"] = check["relative_diff"] <= out["tolerance"] and check["top1_agreement"] >= top1
    return out


def _transformers_tokenizer(directory: Path, name: str) -> Any:
    """transformers' tokenizer read from the file, or None where its reader drops the file's no-prefix setting."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    field = GGUFReader(directory / name).get_field("tokenizer.ggml.add_space_prefix")
    if field is not None and not field.contents():
        return None
    read = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return lambda text: read(text)["input_ids"]


def _ids(encode: Any, tokenizer: Any, texts: list[str], chat: str) -> dict[str, str]:
    same = [text for text in texts if encode(text) == tokenizer(text)["input_ids"]]
    out = {"token_ids": f"{len(same)}/{len(texts)}"}
    if chat:
        out["chat_token_ids"] = _difference(tokenizer, encode(chat), tokenizer(chat)["input_ids"])
    return out


def _difference(tokenizer: Any, theirs: list[int], ours: list[int]) -> str:
    if theirs == ours:
        return "same"
    at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours)))
    show = lambda ids: tokenizer.convert_ids_to_tokens(ids[at : at + 2])  # noqa: E731
    return f"differ from token {at}: {show(theirs)} where the model's tokenizer has {show(ours)}"


def _covered(tokenizer: Any, texts: list[str]) -> list[str]:
    """The texts the tokenizer spells without its unknown token (a character vocabulary has no capitals):
    how readers of a file treat characters the vocabulary lacks is theirs to choose."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return [text for text in texts if text and unk not in tokenizer(text)["input_ids"]]


def _chat_text(tokenizer: Any) -> str:
    return tokenizer.apply_chat_template(CHAT, tokenize=False) if getattr(tokenizer, "chat_template", None) else ""


def failure(name: str, reader: str, check: dict[str, Any], notes: list[str]) -> str:
    """Why ``reader``'s check of the file ``name`` failed (with what is known to differ, if anything)."""
    if not check["logits_passed"]:
        why = f" ({'; '.join(notes)})" if notes else ""
        return (
            f"{name}: {reader} computes logits {check['relative_diff']:.2e} (relative) away from the model's "
            f"(tolerance {check['tolerance']:.2g}), the same top token at {check['top1_agreement']:.0%} of "
            f"positions{why}; nothing was written"
        )
    return (
        f"{name}: {reader} tokenizes the check texts differently from the model's tokenizer "
        f"({check['token_ids']} the same); nothing was written"
    )
