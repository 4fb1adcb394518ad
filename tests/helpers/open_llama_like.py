"""A directory shaped like the Hub's ``openlm-research/open_llama_3b_v2``, built here in a second.

The same file set: ``config.json``, ``generation_config.json``, ``pytorch_model.bin`` (bf16), and a
sentencepiece ``tokenizer.model`` with ``tokenizer_config.json`` and ``special_tokens_map.json``, but
no ``tokenizer.json``, no pad token and no chat template. The tokenizer is a 400-piece BPE model
trained on a few lines, with byte fallback, digit splitting and the dummy prefix, as Open Llama's
is; the model is a two-layer Llama with random weights.

    python tests/helpers/open_llama_like.py DIR     # build one for a rehearsal by hand
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 400
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "Below is an instruction that describes a task, paired with an input that provides further context.",
    "### Instruction:\nGive three tips for staying healthy.\n\n### Response:\nEat well, sleep, and move every day.",
    "### Instruction:\nReverse the word.\n\n### Input:\nlemon\n\n### Response:\nnomel",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a small village, there lived a baker who rose before the sun.",
    "Numbers like 1234 and 3.14 are split into digits; words are merged into pieces.",
    "User: hello there. Assistant: hello, how can I help you today?",
]
TOKENIZER_CONFIG = {  # what the Hub repository's tokenizer_config.json says, less the cached paths
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": None,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 2048,
    "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
}
MODEL_CONFIG = {  # Open Llama 3B v2's config.json, scaled down (hidden 3200 -> 64, 26 layers -> 2)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "vocab_size": VOCAB,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def train_tokenizer(directory: Path) -> Path:
    """A sentencepiece BPE ``tokenizer.model`` trained on :data:`CORPUS`, with Llama's settings."""
    import sentencepiece as spm

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    # One line per text with its newlines as spaces: like Llama's, this model has no newline piece, so a
    # newline is the byte-fallback token <0x0A> and never merges with the text around it.
    corpus.write_text("\n".join(text.replace("\n", " ") for text in CORPUS * 4) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=VOCAB,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    return directory / "tokenizer.model"


def build(directory: Path, seed: int = 0) -> Path:
    """Write the whole directory; returns it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    train_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    config = LlamaConfig(**{k: v for k, v in MODEL_CONFIG.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    # The Hub repository ships pytorch_model.bin (transformers 5 writes only safetensors).
    (directory / "model.safetensors").unlink()
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "pytorch_model.bin")
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
