"""The data people bring: TRL's prompt/completion, ShareGPT conversations, other column names (dolly).

Every format is checked on the Open-Llama-like sentencepiece tokenizer (dummy prefix, byte fallback), where
a prompt and its answer tokenized apart differ from the joined text: the masked tokens must be exactly the
prompt's, the trained ones exactly the answer's (each format trained through the shipped recipe, and the
``data`` command: e2e/test_format_training.py).
"""

from __future__ import annotations

import pytest
from format_records import CONVERSATIONAL, DOLLY, DOLLY_COLUMNS, PROMPT_COMPLETION, SHAREGPT, write

from lowmem_tpu.config import DataSection, ModelSection, RecipeError, load_recipe
from lowmem_tpu.data import IGNORE_INDEX, DataError, build_dataset, exact_match_prompts, set_chat_template
from lowmem_tpu.model import load_tokenizer


@pytest.fixture(scope="module")
def tok(model_dir):
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(model_dir), pad_token="<unk>"))
    set_chat_template(tokenizer, DataSection(format="chat"))  # the shipped plain template, as sft gives it
    return tokenizer


def split(tok, row: dict) -> tuple[list[int], list[int]]:
    """(masked real tokens, trained tokens) of a row."""
    pairs = [
        (t, label) for t, label, m in zip(row["input_ids"], row["labels"], row["attention_mask"], strict=True) if m
    ]
    return [t for t, label in pairs if label == IGNORE_INDEX], [t for t, label in pairs if label != IGNORE_INDEX]


def test_plain_prompt_completion_masks_exactly_the_prompt(tok, tmp_path):
    cfg = DataSection(path=str(write(tmp_path / "pc.jsonl", PROMPT_COMPLETION)), format="prompt_completion")
    rows, stats = build_dataset(cfg, tok)
    assert stats["rows"] == 4 and stats["dropped"] == 0
    for row, record in zip(rows, PROMPT_COMPLETION, strict=True):
        masked, trained = split(tok, row)
        joined = tok(record["prompt"] + record["completion"])["input_ids"]  # BOS + the text as one
        assert masked + trained == [*joined, tok.eos_token_id]
        assert tok.decode(masked, skip_special_tokens=True) == record["prompt"]
        assert tok.decode(trained, skip_special_tokens=True).strip() == record["completion"].strip()
        assert trained[-1] == tok.eos_token_id
    [(ids, answer)] = exact_match_prompts(cfg, tok, cfg.path, 1)
    assert answer == PROMPT_COMPLETION[0]["completion"] and ids == split(tok, rows[0])[0]


def test_conversational_prompt_completion_trains_the_completion_only(tok, tmp_path):
    cfg = DataSection(path=str(write(tmp_path / "conv.jsonl", CONVERSATIONAL)), format="prompt_completion")
    rows, _ = build_dataset(cfg, tok)
    for row, record in zip(rows, CONVERSATIONAL, strict=True):
        masked, trained = split(tok, row)
        prompt = tok.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        assert prompt.startswith(tok.bos_token)  # the saved template writes the BOS every row starts with
        assert masked == tok(prompt, add_special_tokens=False)["input_ids"]
        assert "You reverse words." in tok.decode(masked)  # the system turn is kept
        assert tok.decode(trained, skip_special_tokens=True).strip() == record["completion"][0]["content"]
    [(ids, answer)] = exact_match_prompts(cfg, tok, cfg.path, 1)
    assert answer == "nomel" and ids == split(tok, rows[0])[0]


def test_sharegpt_reads_from_value_turns_as_chat(tok, tmp_path):
    cfg = DataSection(path=str(write(tmp_path / "share.jsonl", SHAREGPT)), format="sharegpt")
    rows, _ = build_dataset(cfg, tok)
    as_chat = [
        {"messages": [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                      for t in record["conversations"]]}
        for record in SHAREGPT
    ]  # fmt: skip
    chat_rows, _ = build_dataset(DataSection(path=str(write(tmp_path / "chat.jsonl", as_chat))), tok)
    assert rows.to_dict() == chat_rows.to_dict()  # the same rows as the same conversation in chat format
    masked, trained = split(tok, rows[0])
    assert tok.decode(masked).startswith("<s>You reverse words.\n\n### User:")  # BOS as the template writes it
    assert tok.decode(trained, skip_special_tokens=True).split() == ["nomel", "lemon"]  # both gpt turns
    [(_, answer)] = exact_match_prompts(cfg, tok, cfg.path, 1)
    assert answer == "lemon"

    bad = write(tmp_path / "bad.jsonl", [{"conversations": [{"from": "narrator", "value": "hi"}]}])
    with pytest.raises(DataError, match=r"record 1: .*unknown speaker 'narrator' \(known: .*gpt, human"):
        build_dataset(DataSection(path=str(bad), format="sharegpt"), tok)


def test_a_column_map_reads_dolly_as_alpaca(tok, tmp_path):
    dolly = write(tmp_path / "dolly.jsonl", DOLLY)
    renamed = [{"instruction": r["instruction"], "input": r["context"], "output": r["response"]} for r in DOLLY]
    alpaca, _ = build_dataset(DataSection(path=str(write(tmp_path / "a.jsonl", renamed)), format="alpaca"), tok)
    cfg = DataSection(path=str(dolly), format="alpaca", columns=DOLLY_COLUMNS)
    mapped, _ = build_dataset(cfg, tok)
    assert mapped.to_dict() == alpaca.to_dict()
    [(_, answer)] = exact_match_prompts(cfg, tok, str(dolly), 1)
    assert answer == "nomel"

    # Without the map: the columns found, and the map that would read them.
    with pytest.raises(DataError) as err:
        build_dataset(DataSection(path=str(dolly), format="alpaca"), tok)
    assert "has: instruction, context, response, category" in str(err.value)
    assert "data.columns: {instruction: instruction, input: context, output: response}" in str(err.value)


def test_wrong_columns_name_what_was_found_and_the_format_that_reads_it(tok, tmp_path):
    share = write(tmp_path / "share.jsonl", SHAREGPT)
    with pytest.raises(DataError, match=r"reads the column\(s\) messages but the data has: conversations.*sharegpt"):
        build_dataset(DataSection(path=str(share), format="chat"), tok)
    pc = write(tmp_path / "pc.jsonl", PROMPT_COMPLETION)
    with pytest.raises(DataError, match=r"has: prompt, completion.*data.format: prompt_completion"):
        build_dataset(DataSection(path=str(pc), format="alpaca"), tok)
    with pytest.raises(DataError, match=r"record 1: column 'prompt' \(prompt_completion prompt\) must be a string"):
        numbers = write(tmp_path / "n.jsonl", [{"prompt": 3, "completion": "x"}])
        build_dataset(DataSection(path=str(numbers), format="prompt_completion"), tok)
    with pytest.raises(RecipeError, match=r"columns: answer is not a field of format alpaca.*instruction, input"):
        load_recipe("recipes/tiny_lora_cpu.yaml", ["data.format=alpaca", "data.columns={answer: response}"])


def test_a_conversational_prompt_needs_a_chat_template(model_dir, tmp_path):
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(model_dir), pad_token="<unk>"))  # no template
    cfg = DataSection(path=str(write(tmp_path / "conv.jsonl", CONVERSATIONAL)), format="prompt_completion")
    with pytest.raises(DataError, match=r"record 1: a conversational prompt/completion .*set data.chat_template"):
        build_dataset(cfg, tokenizer)
