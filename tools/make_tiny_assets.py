"""Build the embedded default's assets deterministically (nothing is downloaded).

Writes into ``lowmem_tpu/assets``:
  tiny-llama/   config.json (a 4-layer Llama) + a character-level tokenizer with a chat template
  reverse/      train.jsonl and eval.jsonl: "reverse abcde" -> "edcba", in chat format; prefer_train.jsonl and
                prefer_eval.jsonl: the same prompts as preference pairs (chosen: the reversal; rejected: a near
                miss: the word as it is, two neighbours swapped, or one letter wrong)

    python tools/make_tiny_assets.py           # write them (after changing this file)
    python tools/make_tiny_assets.py --check   # exit 1 naming each shipped file that differs from its build

The output is byte-identical for the same code; a unit test (tests/unit/test_recipe.py) runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "lowmem_tpu" / "assets"
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHARS = list(string.ascii_lowercase + string.digits + " :,.?!-")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORD_LENGTH = 5


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    # A BPE without merges is a character-level tokenizer: every character is one token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,  # BOS before every text, as Llama's tokenizer puts it (its post-processor)
        # No pad token, like Llama: lowmem-tpu must pick one without hiding the EOS.
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return len(vocab)


def write_config(out: Path, vocab_size: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": -(-vocab_size // 16) * 16,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def sample(rng: random.Random) -> dict:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(WORD_LENGTH))
    return {
        "messages": [
            {"role": "user", "content": f"reverse {word}"},
            {"role": "assistant", "content": word[::-1]},
        ]
    }


def write_dataset(out: Path, n_train: int = 4000, n_eval: int = 200) -> None:
    rng = random.Random(1234)
    rows, seen = [], set()
    while len(rows) < n_train + n_eval:
        row = sample(rng)
        prompt = row["messages"][0]["content"]
        if prompt not in seen:
            seen.add(prompt)
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:n_train]), ("eval", rows[n_train:])):
        lines = (json.dumps(r, separators=(",", ":")) for r in part)
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    rng = random.Random(4321)
    for name, part in (("prefer_train", rows[: n_train // 2]), ("prefer_eval", rows[n_train:])):
        lines = (json.dumps(preference_pair(r, rng), separators=(",", ":")) for r in part)
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def preference_pair(row: dict, rng: random.Random) -> dict:
    """A chat sample as a preference pair: its answer chosen, a near miss rejected."""
    prompt, answer = row["messages"][0], row["messages"][1]["content"]
    wrong = answer
    while wrong == answer:
        kind, at = rng.randrange(3), rng.randrange(WORD_LENGTH - 1)
        if kind == 0:
            wrong = answer[::-1]  # not reversed
        elif kind == 1:
            wrong = answer[:at] + answer[at + 1] + answer[at] + answer[at + 2 :]
        else:
            wrong = answer[:at] + rng.choice(string.ascii_lowercase) + answer[at + 1 :]
    return {
        "prompt": [prompt],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def build(assets: Path) -> list[Path]:
    """Write the assets under ``assets``; the files written, relative to it."""
    model_dir = assets / "tiny-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_config(model_dir, build_tokenizer(model_dir))
    write_dataset(assets / "reverse")
    return sorted(p.relative_to(assets) for part in ("tiny-llama", "reverse") for p in (assets / part).rglob("*"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming each shipped file that differs")
    if not parser.parse_args(argv).check:
        build(ASSETS)
        print(f"wrote {ASSETS / 'tiny-llama'} and {ASSETS / 'reverse'}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        built = build(Path(tmp))
        differ = [f"{p}: differs" for p in built if not _same(ASSETS / p, Path(tmp) / p)]
    shipped = sorted(p.relative_to(ASSETS) for part in ("tiny-llama", "reverse") for p in (ASSETS / part).rglob("*"))
    differ += [f"{p}: not built by this" for p in shipped if p not in built]
    for line in differ:
        print(f"lowmem_tpu/assets/{line}", file=sys.stderr)
    if differ:
        print("run: python tools/make_tiny_assets.py", file=sys.stderr)
    return 1 if differ else 0


def _same(shipped: Path, built: Path) -> bool:
    return shipped.is_file() and shipped.read_bytes() == built.read_bytes()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
