"""The Open Llama path rehearsed on the CPU: its sentencepiece tokenizer and alpaca data (training on its bf16
weights, LoRA and full: e2e/test_open_llama.py).

The model directory (``open_llama_like.build``) has the Hub repository's file set: tokenizer.model without
tokenizer.json, no pad token, no chat template, pytorch_model.bin in bf16.
"""

from __future__ import annotations

import json
import time

import pytest
from open_llama_data import ALPACA, tokenizer_of

from lowmem_tpu.config import DataSection, load_recipe
from lowmem_tpu.data import IGNORE_INDEX, DataError, build_dataset, exact_match_prompts, set_chat_template


def test_the_hub_file_set_loads_with_the_slow_and_the_fast_tokenizer(model_dir):
    assert not (model_dir / "tokenizer.json").exists() and (model_dir / "tokenizer.model").exists()
    slow, fast = tokenizer_of(model_dir, False), tokenizer_of(model_dir, True)
    text = "### Response:\nParis is the capital of France. 1234"
    assert slow(text)["input_ids"] == fast(text)["input_ids"]
    assert slow.pad_token == "<unk>" and slow.pad_token_id == 0 and slow.eos_token_id == 2
    assert "<0x0A>" in slow.convert_ids_to_tokens(slow(text)["input_ids"])  # a newline is a byte token
    assert slow.chat_template is None


@pytest.mark.parametrize("fast", [False, True])
def test_alpaca_trains_on_the_tokens_of_the_joined_text(model_dir, alpaca, fast):
    tokenizer = tokenizer_of(model_dir, fast)
    cfg = DataSection(path=str(alpaca), format="alpaca", max_length=128)
    rows, stats = build_dataset(cfg, tokenizer)
    assert stats["truncated"] == 0 and stats["rows"] == len(ALPACA) * 8
    from lowmem_tpu.data import alpaca_prompt

    for row, record in zip(rows.select(range(len(ALPACA))), ALPACA, strict=True):
        prompt = alpaca_prompt(record["instruction"], record["input"])
        joined = tokenizer(prompt + record["output"])["input_ids"]  # what the merged model will be fed
        length = sum(row["attention_mask"])
        assert row["input_ids"][:length] == [*joined, tokenizer.eos_token_id]
        trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
        assert tokenizer.decode(trained, skip_special_tokens=True) == record["output"]
        assert not tokenizer.convert_ids_to_tokens(trained[0]).startswith("▁")  # no dummy prefix after "\n"
    # Exact match feeds the very prompt tokens that training masked.
    prompts = exact_match_prompts(cfg, tokenizer, str(alpaca), 3)
    for (ids, answer), row, record in zip(prompts, rows.select(range(3)), ALPACA, strict=False):
        first_trained = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        assert ids == row["input_ids"][:first_trained] and answer == record["output"]


def test_chat_on_a_tokenizer_without_a_template_uses_the_plain_one(model_dir, tmp_path):
    tokenizer = tokenizer_of(model_dir)
    path = tmp_path / "chat.jsonl"
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse lemon"},
        {"role": "assistant", "content": "nomel"},
        {"role": "user", "content": "And paris?"},
        {"role": "assistant", "content": "sirap"},
    ]
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    cfg = DataSection(path=str(path), max_length=128)
    with pytest.raises(DataError, match=r"needs a chat template .* set data\.chat_template"):
        build_dataset(cfg, tokenizer)
    assert "plain" in set_chat_template(tokenizer, cfg)
    rows, _ = build_dataset(cfg, tokenizer)
    row = rows[0]
    trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "nomel</s>\n\nsirap</s>\n\n"  # each answer, its EOS and the turn's end
    chatml = DataSection(path=str(path), max_length=256, chat_template="chatml")
    set_chat_template(tokenizer, chatml)
    rows, _ = build_dataset(chatml, tokenizer)
    assert "<|im_start|>assistant" in tokenizer.decode(rows[0]["input_ids"])


def test_text_and_long_samples(model_dir, tmp_path):
    tokenizer = tokenizer_of(model_dir)
    path = tmp_path / "text.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * n}) for n in (1, 40))
    )
    rows, stats = build_dataset(DataSection(path=str(path), format="text", max_length=64), tokenizer)
    assert stats["truncated"] == 1 and stats["longest"] > 64
    assert rows[0]["input_ids"][0] == tokenizer.bos_token_id and tokenizer.eos_token_id in rows[0]["input_ids"]
    assert all(len(r) == 64 for r in rows["input_ids"])


def test_tokenized_rows_are_cached_by_records_tokenizer_and_settings(model_dir, alpaca, tmp_path):
    tokenizer = tokenizer_of(model_dir)
    cfg = DataSection(path=str(alpaca), format="alpaca", max_length=128)
    first, stats = build_dataset(cfg, tokenizer, cache_dir=tmp_path)
    again, cached = build_dataset(cfg, tokenizer, cache_dir=tmp_path)
    assert not stats["cached"] and cached["cached"] and first["input_ids"] == again["input_ids"]
    assert again.features["input_ids"].feature.dtype == "int32"
    _, other = build_dataset(cfg.model_copy(update={"max_length": 120}), tokenizer, cache_dir=tmp_path)
    assert not other["cached"] and len(list(tmp_path.iterdir())) == 2
    edited = tmp_path.parent / "edited.json"
    edited.write_text(json.dumps(ALPACA))
    build_dataset(cfg.model_copy(update={"path": str(edited)}), tokenizer, cache_dir=tmp_path)
    time.sleep(1.1)  # a new modification time, as an edit would leave
    edited.write_text(json.dumps(ALPACA[::-1]))
    _, changed = build_dataset(cfg.model_copy(update={"path": str(edited)}), tokenizer, cache_dir=tmp_path)
    assert not changed["cached"]  # edited records are tokenized again


def test_a_held_out_fraction_is_never_trained_on(model_dir, alpaca):
    tokenizer = tokenizer_of(model_dir)
    cfg = DataSection(path=str(alpaca), format="alpaca", max_length=128, eval_fraction=0.25, mask_prompt=False)
    _, stats = build_dataset(cfg, tokenizer)
    _, held_stats = build_dataset(cfg, tokenizer, role="eval")
    assert held_stats["samples"] == 20 and stats["samples"] == 60
    from lowmem_tpu.data import select_records

    train_records, _ = select_records(cfg, "train")
    eval_records, _ = select_records(cfg, "eval")
    assert len(train_records) + len(eval_records) == 80
    with pytest.raises(Exception, match="evaluation would score the training records"):
        load_recipe(None, [f"data.path={alpaca}", f"data.eval_path={alpaca}", "data.format=alpaca"])
