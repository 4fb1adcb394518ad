"""Data loading, formats and static-shape tokenization, on the bundled char-level tokenizer and real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lowmem_tpu.config import DataSection
from lowmem_tpu.config.assets import ASSETS
from lowmem_tpu.data import DataError, build_dataset, collate, exact_match_prompts, load_records

TOKENIZER = ASSETS / "tiny-llama"


def make_tokenizer(pad: str = "unk"):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.pad_token = getattr(tokenizer, f"{pad}_token")
    return tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer("unk")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def trained_text(tokenizer, row: dict) -> str:
    return tokenizer.decode([label for label in row["labels"] if label != -100])


def real_text(tokenizer, row: dict) -> str:
    return tokenizer.decode([i for i, m in zip(row["input_ids"], row["attention_mask"], strict=True) if m])


def check_static(dataset, cfg: DataSection) -> None:
    packed = ["position_ids", "segment_ids"] if cfg.packing else []
    assert dataset.column_names == ["input_ids", "attention_mask", "labels", *packed]
    for row in dataset:
        assert {len(row[key]) for key in dataset.column_names} == {cfg.max_length}
        mask = row["attention_mask"]
        assert mask == sorted(mask, reverse=True)  # right padding
        assert all(label == -100 for label, m in zip(row["labels"], mask, strict=True) if not m)


# --------------------------------------------------------------------------- formats


def test_text_trains_every_token_and_ends_with_eos(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "hello"}, {"body": "ab"}])
    cfg = DataSection(path=str(path), format="text", columns={"text": "body"}, max_length=12)
    dataset, stats = build_dataset(cfg, tok)
    check_static(dataset, cfg)
    row = dataset[0]
    assert row["input_ids"][:7] == [tok.bos_token_id, *tok("hello", add_special_tokens=False)["input_ids"], 2]
    assert row["attention_mask"] == [1] * 7 + [0] * 5
    assert row["labels"] == row["input_ids"][:7] + [-100] * 5
    assert row["input_ids"][7:] == [tok.pad_token_id] * 5
    assert stats == {
        "samples": 2,
        "rows": 2,
        "truncated": 0,
        "dropped": 0,
        "dropped_too_long": 0,
        "dropped_untrained": 0,
        "longest": 7,
        "lengths": {"p50": 7, "p90": 7, "p99": 7, "max": 7},
        "tokens": 11,
        "trained_tokens": 11,
        "cached": False,
    }


@pytest.mark.parametrize("extra", ["", "some input"])
def test_alpaca_masks_the_prompt(tok, tmp_path, extra):
    record = {"instruction": "reverse abc", "output": "cba"}
    if extra:
        record["input"] = extra
    path = write_jsonl(tmp_path / "a.jsonl", [record])
    cfg = DataSection(path=str(path), format="alpaca", max_length=256)
    dataset, stats = build_dataset(cfg, tok)
    check_static(dataset, cfg)
    row = dataset[0]
    assert trained_text(tok, row) == "cba</s>"
    length = sum(row["attention_mask"])
    # The trained tokens are exactly the last four real positions: the output and the EOS.
    assert [i for i, label in enumerate(row["labels"]) if label != -100] == list(range(length - 4, length))
    assert row["input_ids"][0] == tok.bos_token_id
    prompt = real_text(tok, row)
    assert ("some input" in prompt) == bool(extra)
    assert prompt.endswith(":<unk>cba</s>")  # "### Response:\n": this vocabulary has no '#' or newline
    assert stats["trained_tokens"] == 4

    unmasked, _ = build_dataset(cfg.model_copy(update={"mask_prompt": False}), tok)
    assert unmasked[0]["labels"][:length] == row["input_ids"][:length]


def test_chat_trains_only_assistant_turns(tok, tmp_path):
    conversation = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ab"},
            {"role": "user", "content": "yo"},
            {"role": "assistant", "content": "cd"},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [conversation])
    cfg = DataSection(path=str(path), format="chat", max_length=32)
    dataset, stats = build_dataset(cfg, tok)
    check_static(dataset, cfg)
    row = dataset[0]
    # <s> <|user|> h i <|assistant|> a b </s> <|user|> y o <|assistant|> c d </s>: BOS leads, as in pretraining
    assert real_text(tok, row) == "<s><|user|>hi<|assistant|>ab</s><|user|>yo<|assistant|>cd</s>"
    trained = [i for i, label in enumerate(row["labels"]) if label != -100]
    assert trained == [5, 6, 7, 12, 13, 14]
    assert tok.decode([row["labels"][i] for i in trained]) == "ab</s>cd</s>"
    assert stats["tokens"] == 15 and stats["trained_tokens"] == 6

    unmasked, _ = build_dataset(cfg.model_copy(update={"mask_prompt": False}), tok)
    assert unmasked[0]["labels"][:14] == row["input_ids"][:14]


def test_eos_is_learned_when_pad_is_eos(tmp_path):
    tokenizer = make_tokenizer("eos")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    path = write_jsonl(tmp_path / "c.jsonl", [chat("reverse ab", "ba")])
    cfg = DataSection(path=str(path), format="chat", max_length=24)
    dataset, _ = build_dataset(cfg, tokenizer)
    check_static(dataset, cfg)
    row = dataset[0]
    length = sum(row["attention_mask"])
    assert row["input_ids"][length - 1] == row["labels"][length - 1] == tokenizer.eos_token_id
    assert row["input_ids"][length:] == [tokenizer.eos_token_id] * (24 - length)
    assert trained_text(tokenizer, row) == "ba</s>"


def test_chat_needs_a_template(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")])
    with pytest.raises(DataError, match="chat template"):
        build_dataset(DataSection(path=str(path)), tokenizer)


def test_a_turn_is_located_where_a_template_renders_prefixes_differently(tmp_path):
    tokenizer = make_tokenizer()
    # The message count at the front changes every prefix of the conversation: the turn is found in context.
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")])
    cfg = DataSection(path=str(path), max_length=16)
    dataset, _ = build_dataset(cfg, tokenizer)
    assert trained_text(tokenizer, dataset[0]) == "b</s>"
    dataset, _ = build_dataset(cfg.model_copy(update={"mask_prompt": False}), tokenizer)
    assert trained_text(tokenizer, dataset[0]) == "<s>2<|user|>a<|assistant|>b</s>"


def test_a_template_that_rewrites_the_content_is_refused(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | upper")
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")])
    with pytest.raises(DataError, match=r"record 1: assistant message 2 .* cannot be located.*mask_prompt: false"):
        build_dataset(DataSection(path=str(path), max_length=16), tokenizer)


def test_no_pad_token_is_an_error(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")])
    with pytest.raises(DataError, match=r"model.pad_token"):
        build_dataset(DataSection(path=str(path)), tokenizer)


# --------------------------------------------------------------------------- length, packing, sampling


def texts(tmp_path: Path, lengths: list[int]) -> Path:
    return write_jsonl(tmp_path / "t.jsonl", [{"text": "abcdefghij"[:n]} for n in lengths])


def test_too_long_truncate_drop_error(tok, tmp_path):
    path = texts(tmp_path, [2, 8, 10, 3])  # + BOS + EOS: 4, 10, 12, 5 tokens
    cfg = DataSection(path=str(path), format="text", max_length=8)

    dataset, stats = build_dataset(cfg, tok)
    check_static(dataset, cfg)
    assert (stats["rows"], stats["truncated"], stats["dropped"], stats["longest"]) == (4, 2, 0, 12)
    assert dataset[1]["attention_mask"] == [1] * 8
    assert stats["tokens"] == 4 + 8 + 8 + 5

    dataset, stats = build_dataset(cfg.model_copy(update={"too_long": "drop"}), tok)
    assert (stats["rows"], stats["truncated"], stats["dropped"]) == (2, 0, 2)
    assert [real_text(tok, row) for row in dataset] == ["<s>ab</s>", "<s>abc</s>"]

    with pytest.raises(DataError, match=r"2 of 4 samples .* data.max_length=8 .* longest has 12.*too_long"):
        build_dataset(cfg.model_copy(update={"too_long": "error"}), tok)

    with pytest.raises(DataError, match="no samples left"):
        build_dataset(cfg.model_copy(update={"too_long": "drop", "max_length": 3}), tok)


def test_truncation_that_cuts_off_the_answer_drops_the_row(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat("reverse abcdefgh", "hgfedcba"), chat("a", "b")])
    cfg = DataSection(path=str(path), max_length=12)  # the first prompt alone is 1 + 16 + 1 tokens
    dataset, stats = build_dataset(cfg, tok)
    assert (stats["samples"], stats["rows"], stats["truncated"], stats["dropped"]) == (2, 1, 0, 1)
    assert stats["dropped_untrained"] == 1  # counted once: dropped, not also truncated
    assert trained_text(tok, dataset[0]) == "b</s>"


def test_packing_keeps_whole_samples_apart_and_loses_no_token(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(f"reverse {w}", w[::-1]) for w in ["abc", "de", "fghij", "k"]])
    cfg = DataSection(path=str(path), max_length=48)
    padded, padded_stats = build_dataset(cfg, tok)
    cfg = cfg.model_copy(update={"packing": True})
    packed, stats = build_dataset(cfg, tok)
    check_static(packed, cfg)
    assert stats["tokens"] == padded_stats["tokens"] and stats["trained_tokens"] == padded_stats["trained_tokens"]
    assert stats["rows"] < padded_stats["rows"]
    samples = [[v for v, m in zip(row["input_ids"], row["attention_mask"], strict=True) if m] for row in padded]
    found = []
    for row in packed:
        segments = row["segment_ids"]
        for segment in sorted(set(segments) - {0}):
            where = [i for i, s in enumerate(segments) if s == segment]
            assert where == list(range(where[0], where[-1] + 1))  # contiguous
            assert [row["position_ids"][i] for i in where] == list(range(len(where)))  # positions restart
            assert row["labels"][where[0]] == -100  # never the target of the previous sample's last token
            found.append([row["input_ids"][i] for i in where])
        assert all(m == (s != 0) for m, s in zip(row["attention_mask"], segments, strict=True))
    assert found == samples  # every sample whole, in order


def test_max_samples(tok):
    cfg = DataSection(max_length=24, max_samples=5)
    assert build_dataset(cfg, tok)[1]["samples"] == 5
    dataset, stats = build_dataset(cfg, tok, max_samples=3)
    assert stats["samples"] == stats["rows"] == len(dataset) == 3


# --------------------------------------------------------------------------- loading and user errors


def test_builtin_dataset(tok):
    records = load_records("builtin:reverse/train.jsonl")
    assert len(records) == 4000 and records.column_names == ["messages"]
    cfg = DataSection(max_length=24)  # the default: builtin:reverse/train.jsonl, chat
    dataset, stats = build_dataset(cfg, tok, path="builtin:reverse/eval.jsonl", max_samples=16)
    check_static(dataset, cfg)
    assert stats["rows"] == 16 and stats["dropped"] == stats["truncated"] == 0
    with pytest.raises(DataError, match="no built-in dataset"):
        load_records("builtin:nope.jsonl")


def test_csv_parquet_and_json_array(tok, tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"instruction": ["reverse ab", "reverse xyz"], "input": ["", "x"], "output": ["ba", "zyx"]})
    frame.to_csv(tmp_path / "a.csv", index=False)
    frame.to_parquet(tmp_path / "a.parquet")
    (tmp_path / "a.json").write_text(json.dumps(frame.to_dict(orient="records"), indent=2))
    for name in ["a.csv", "a.parquet", "a.json"]:
        cfg = DataSection(path=str(tmp_path / name), format="alpaca", max_length=256)
        dataset, stats = build_dataset(cfg, tok)
        assert stats["rows"] == 2, name
        assert [trained_text(tok, row) for row in dataset] == ["ba</s>", "zyx</s>"], name


def test_json_lines_in_a_json_file(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [{"text": "a"}, {"text": "b"}])
    assert load_records(str(path))["text"] == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "a"}\n\n{"text": "b"}\n{"text": \n', r"bad.jsonl: line 4 is not valid JSON"),
        ("list.jsonl", '{"text": "a"}\n[1, 2]\n', r"line 2 is a JSON list, not an object"),
        ("bad.json", '[\n  {"text": "a"},\n  {"text": }\n]\n', r"bad.json: line 3 is not valid JSON"),
        ("empty.jsonl", "\n", r"holds no records"),
        ("empty.json", "[]", r"holds no records"),
        ("data.txt", "hello", r"unsupported file type '.txt'"),
    ],
)
def test_malformed_files(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        load_records(str(tmp_path / name))


@pytest.mark.parametrize("name", ["latin1.jsonl", "latin1.json", "latin1.csv"])
def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path, name):
    """pyarrow reads such bytes and fails with a traceback only when a row is used: refused at load."""
    first = b"text\n" if name.endswith(".csv") else b'{"text": "fine"}\n'
    bad = b"caf\xe9\n" if name.endswith(".csv") else b'{"text": "caf\xe9"}\n'
    (tmp_path / name).write_bytes(first + bad)
    with pytest.raises(DataError, match=rf"{name}: line 2 is not UTF-8 \(byte 0xe9 at column \d+\); save the file"):
        load_records(str(tmp_path / name))


def test_missing_file_and_unreachable_hub(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    with pytest.raises(DataError, match="not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    # Offline mode makes the failure immediate instead of five network retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"could not load the Hub dataset 'someone/nothing'.*local .jsonl"):
        load_records("someone/nothing")


def test_missing_field_lists_the_columns(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "x", "id": 1}])
    with pytest.raises(DataError, match=r"reads the column\(s\) text but the data has: body, id.*data.columns"):
        build_dataset(DataSection(path=str(path), format="text"), tok)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")])
    expected = r"instruction, input \(optional\), output but.*has: messages.*data.format: chat"
    with pytest.raises(DataError, match=expected):
        build_dataset(DataSection(path=str(path), format="alpaca"), tok)


@pytest.mark.parametrize(
    ("fmt", "second", "message"),
    [
        ("chat", {"messages": "just text"}, r"column 'messages' must be a non-empty list.*not str 'just text'"),
        ("chat", {"messages": []}, r"must be a non-empty list of \{role, content\} messages, not list \[\]"),
        ("chat", {"messages": [{"role": "user", "content": None}]}, r"a user message has no string content"),
        ("chat", {"messages": [{"content": "hi"}]}, r"messages; got dict \{'content': 'hi'\}"),
        ("alpaca", {"instruction": "c", "output": 5}, r"column 'output' \(alpaca output\) must be a string, not int 5"),
        ("alpaca", {"instruction": ["c"], "output": "d"}, r"'instruction' .* must be a string, not list \['c'\]"),
        ("alpaca", {"instruction": "c"}, r"column 'output' \(alpaca output\) must be a string, not missing or null"),
    ],
)
def test_bad_values_name_the_file_the_record_and_the_fix(tok, tmp_path, fmt, second, message):
    first = chat("a", "b") if fmt == "chat" else {"instruction": "a", "output": "b"}
    path = write_jsonl(tmp_path / "bad.jsonl", [first, second])
    with pytest.raises(DataError, match=rf"^{path}: record 2: .*{message}.*; fix or remove that record$"):
        build_dataset(DataSection(path=str(path), format=fmt), tok)


def test_nothing_to_train(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=r"no samples left.*1 had no trained token"):
        build_dataset(DataSection(path=str(path)), tok)


# --------------------------------------------------------------------------- evaluation and batching


def test_exact_match_prompts(tok, tmp_path):
    cfg = DataSection(max_length=24)
    prompts = exact_match_prompts(cfg, tok, "builtin:reverse/eval.jsonl", 3)
    first = load_records("builtin:reverse/eval.jsonl")[0]["messages"]
    assert len(prompts) == 3
    ids, answer = prompts[0]
    assert answer == first[1]["content"]
    assert tok.decode(ids) == f"<s><|user|>{first[0]['content']}<|assistant|>"

    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "reverse ab", "output": "ba"}])
    alpaca = DataSection(path=str(path), format="alpaca")
    [(ids, answer)] = exact_match_prompts(alpaca, tok, str(path), 10)
    row = build_dataset(alpaca, tok)[0][0]
    assert answer == "ba" and row["input_ids"][: len(ids)] == ids and row["labels"][len(ids) - 1] == -100
    assert row["labels"][len(ids)] != -100

    with pytest.raises(DataError, match="exact-match"):
        exact_match_prompts(DataSection(format="text"), tok, str(path), 1)


def test_collate(tok):
    cfg = DataSection(max_length=24)
    dataset, _ = build_dataset(cfg, tok, max_samples=4)
    batch = collate([dataset[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for tensor in batch.values():
        assert tensor.dtype == torch.long and tensor.shape == (4, 24)
    assert torch.equal(batch["input_ids"][2], torch.tensor(dataset[2]["input_ids"]))


def test_a_conversation_that_opens_with_the_assistant_trains_that_turn_from_its_content(tmp_path):
    tokenizer = make_tokenizer()
    opening = {"messages": [{"role": "assistant", "content": "hi"}, *chat("a", "b")["messages"]]}
    path = write_jsonl(tmp_path / "c.jsonl", [opening])
    dataset, _ = build_dataset(DataSection(path=str(path), max_length=24), tokenizer)
    assert trained_text(tokenizer, dataset[0]) == "hi</s>b</s>"
