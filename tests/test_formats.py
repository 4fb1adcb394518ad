"""The data people bring: TRL's prompt/completion, ShareGPT conversations, other column names (dolly).

Every format is checked on the Open-Llama-like sentencepiece tokenizer (dummy prefix, byte fallback), where
a prompt and its answer tokenized apart differ from the joined text: the masked tokens must be exactly the
prompt's, the trained ones exactly the answer's, and each format trains through the shipped recipe.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from open_llama_like import build

from lowmem_tpu.config import DataSection, ModelSection, RecipeError, load_recipe
from lowmem_tpu.data import IGNORE_INDEX, DataError, build_dataset, exact_match_prompts, set_chat_template
from lowmem_tpu.model import load_tokenizer

PROMPT_COMPLETION = [
    {"prompt": f"Reverse the word {word}.\nAnswer:", "completion": f" {word[::-1]}"}
    for word in ("lemon", "paris", "bread", "stone")
]
CONVERSATIONAL = [
    {
        "prompt": [
            {"role": "system", "content": "You reverse words."},
            {"role": "user", "content": f"Reverse {word}."},
        ],
        "completion": [{"role": "assistant", "content": word[::-1]}],
    }
    for word in ("lemon", "paris", "bread", "stone")
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "You reverse words."},
            {"from": "human", "value": f"Reverse {word}."},
            {"from": "gpt", "value": word[::-1]},
            {"from": "human", "value": "And again?"},
            {"from": "gpt", "value": word},
        ]
    }
    for word in ("lemon", "paris", "bread", "stone")
]
DOLLY = [  # databricks-dolly-15k's columns
    {"instruction": "Reverse the word.", "context": word, "response": word[::-1], "category": "open_qa"}
    for word in ("lemon", "paris", "bread", "stone")
]
DOLLY_COLUMNS = {"instruction": "instruction", "input": "context", "output": "response"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("open_llama_like"))


@pytest.fixture(scope="module")
def tok(model_dir):
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(model_dir), pad_token="<unk>"))
    set_chat_template(tokenizer, DataSection(format="chat"))  # the shipped plain template, as sft gives it
    return tokenizer


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "records", "extra"),
    [
        ("prompt_completion", PROMPT_COMPLETION * 4, []),
        ("prompt_completion", CONVERSATIONAL * 4, ["data.chat_template=plain"]),
        ("sharegpt", SHAREGPT * 4, []),
        ("alpaca", DOLLY * 4, ["data.columns={instruction: instruction, input: context, output: response}"]),
    ],
)
def test_each_format_trains_through_the_shipped_recipe(model_dir, tmp_path, fmt, records, extra):
    from lowmem_tpu.sft import run_sft

    data = write(tmp_path / f"{fmt}.jsonl", records)
    local = [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={model_dir}", f"data.path={data}"]
    local += ["runtime.device=cpu", "runtime.num_cpu_devices=4", "data.max_length=128", "train.global_batch_size=8"]
    local += [
        "train.max_steps=2",
        "train.logging_steps=1",
        "train.warmup_steps=0",
        "train.save_steps=null",
        "train.max_wall_time=null",
        "runtime.compile_cache_dir=null",
    ]
    run = run_sft(load_recipe("recipes/open_llama_lora.yaml", [f"data.format={fmt}", *local, *extra]))
    losses = [e["loss"] for e in run.metrics["train"]["losses"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert run.metrics["data"]["rows"] == 16 and run.metrics["data"]["dropped"] == 0


def test_the_data_command_shows_what_is_trained_and_what_is_cut(model_dir, tmp_path):
    import subprocess
    import sys

    records = [{**r, "response": r["response"] * (40 if i == 1 else 1)} for i, r in enumerate(DOLLY)]  # 2nd: long
    dolly = write(tmp_path / "dolly.jsonl", [*records, {"instruction": "stone " * 80, "context": "", "response": "x"}])
    args = ["recipes/open_llama_lora.yaml", f"model.name_or_path={model_dir}", f"data.path={dolly}"]
    args += ["data.format=alpaca", "data.columns={instruction: instruction, input: context, output: response}"]
    args += [f"output_dir={tmp_path / 'run'}", "data.max_length=160"]

    def cli(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "lowmem_tpu.cli", "data", *args, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])

    proc = cli("--rows", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "### Response:\n\u27e6nomel</s>\u27e7" in out  # the answer and EOS trained, the prompt not
    assert "--- record 2:" in out and "truncated:" in out and "--- record 3" not in out
    assert (
        "all 5 records -> 4 rows of 160 tokens: 1 truncated, 1 dropped (1 with nothing to train)" in out
    )  # the 5th's answer is cut off
    assert (tmp_path / "run" / "data_cache").is_dir()  # sft reads these rows instead of tokenizing again

    proc = cli("--rows", "1", "--json")
    report = json.loads(proc.stdout)
    [row] = report["rows"]
    assert [text for trained, text in row["spans"] if trained] == ["nomel</s>"] and row["fate"] == "fits"
    assert report["stats"]["dropped_untrained"] == 1 and report["stats"]["lengths"]["max"] > 160

    proc = cli("data.format=chat", "data.columns={}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has: instruction, context, response, category" in proc.stderr
