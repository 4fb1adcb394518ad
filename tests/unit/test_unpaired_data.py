"""KTO's rows (``data.format: unpaired``, and preference pairs read as KTO reads them) against TRL's own
preparation: the prompt and completion ids and labels equal what ``KTOTrainer._prepare_dataset`` makes of the
same records; the KL rows of a batch; bad records and data a method cannot serve (exit 2, naming the fix)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from cli_runs import command_cli

from lowmem_tpu.config import DataSection, ModelSection
from lowmem_tpu.data import DataError, build_dataset, exact_match_prompts, set_chat_template
from lowmem_tpu.data.unpaired import collate_unpaired
from lowmem_tpu.model import load_tokenizer

UNPAIRED_PLAIN = [
    {"prompt": "reverse abc", "completion": " cba", "label": True},
    {"prompt": "reverse hello", "completion": " hello", "label": False},
    {"prompt": "reverse ab", "completion": " ba", "label": True},
]
UNPAIRED_CHAT = [
    {
        "prompt": [{"role": "user", "content": "reverse abc"}],
        "completion": [{"role": "assistant", "content": "cba"}],
        "label": False,
    },
    {
        "prompt": [{"role": "user", "content": "reverse ab"}],
        "completion": [{"role": "assistant", "content": "ba"}],
        "label": True,
    },
]
PAIRED = [
    {"prompt": "reverse abc", "chosen": " cba", "rejected": " abc"},
    {"prompt": "reverse hello world", "chosen": " dlrow olleh", "rejected": " hello world"},
]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(ModelSection(name_or_path="builtin:tiny-llama", pad_token="<unk>"))
    set_chat_template(tokenizer, DataSection(format="preference"))
    return tokenizer


def _trl(tok, records) -> list[tuple]:
    """TRL 1.16's own preparation (``KTOTrainer._prepare_dataset``, no trainer built, no KL columns)."""
    import contextlib

    import datasets
    import trl.trainer.kto_trainer as kto
    from trl import KTOTrainer

    kto.global_then_local_main_first = contextlib.nullcontext
    args = SimpleNamespace(dataset_num_proc=None, max_length=None)
    trainer = SimpleNamespace(_tokenizer=tok, calculate_KL=False)
    prepared = KTOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), tok, args, "t")
    return [(row["prompt_ids"], row["completion_ids"], row["label"]) for row in prepared]


def _ours(rows) -> list[tuple]:
    out = []
    for row in rows:
        ids, real, completion = row["input_ids"], row["attention_mask"], row["completion_mask"]
        start = completion.index(1)
        out.append((ids[:start], [t for t, m in zip(ids, completion, strict=True) if m], row["label"]))
        assert sum(real) == start + sum(completion)  # padding: never trained
    return out


@pytest.mark.parametrize(
    ("records", "fmt"),
    [(UNPAIRED_PLAIN, "unpaired"), (UNPAIRED_CHAT, "unpaired"), (PAIRED, "preference")],
    ids=["plain", "chat", "pairs-unpaired"],
)
def test_rows_are_tokenized_and_labelled_as_trls_kto_prepares_them(tok, records, fmt, tmp_path):
    cfg = DataSection(path=_write(tmp_path / "d.jsonl", records), format=fmt, max_length=48)
    rows, stats = build_dataset(cfg, tok, unpaired=True)
    assert _ours(rows) == _trl(tok, records)
    assert stats["rows"] == len(_trl(tok, records)) and stats["desirable"] == sum(r[2] for r in _trl(tok, records))


def test_each_kl_row_is_the_prompt_with_the_previous_rows_completion(tok, tmp_path):
    cfg = DataSection(path=_write(tmp_path / "d.jsonl", UNPAIRED_PLAIN), format="unpaired", max_length=48)
    rows, _ = build_dataset(cfg, tok, unpaired=True)
    batch = collate_unpaired([rows[i] for i in range(3)])
    parts = _ours(rows)
    assert batch["label"].tolist() == [True, False, True]
    for i in range(3):
        prompt, completion = parts[i][0], parts[i - 1][1]  # row 0 takes the last row's completion
        ids, mask = batch["KL_input_ids"][i].tolist(), batch["KL_completion_mask"][i].tolist()
        assert ids[: len(prompt) + len(completion)] == prompt + completion
        assert mask == [0] * len(prompt) + [1] * len(completion) + [0] * (48 - len(prompt) - len(completion))
        assert batch["KL_attention_mask"][i].sum() == len(prompt) + len(completion)
    prompts = exact_match_prompts(cfg, tok, cfg.path, 5)  # the desirable rows' completions are the answers
    assert [answer for _, answer in prompts] == [" cba", " ba"]


def test_bad_labels_and_data_a_method_cannot_serve_exit_2(tok, tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": " b", "label": "yes"}])
    with pytest.raises(DataError, match=r"record 1: column 'label' \(label\) must be true"):
        build_dataset(DataSection(path=bad, format="unpaired", max_length=32), tok, unpaired=True)
    out = f"output_dir={tmp_path / 'run'}"
    kto_file = _write(tmp_path / "kto.jsonl", UNPAIRED_PLAIN)
    with pytest.raises(DataError, match=r"data\.format: unpaired"):  # a KTO file given as pairs (to DPO)
        build_dataset(DataSection(path=kto_file, format="preference", max_length=32), tok)
    unpaired_dpo = command_cli("dpo", "recipes/tiny_kto_cpu.yaml", "data.format=unpaired", out)
    assert unpaired_dpo.returncode == 2 and "run it with kto" in unpaired_dpo.stderr
    assert "Traceback" not in unpaired_dpo.stderr
    pairs = _write(tmp_path / "pairs.jsonl", PAIRED)
    with pytest.raises(DataError, match=r"data\.format: preference"):  # pairs given as unpaired rows
        build_dataset(DataSection(path=pairs, format="unpaired", max_length=32), tok, unpaired=True)
    assert not (tmp_path / "run").exists()
