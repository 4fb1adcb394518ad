"""Preference pairs (``data.format: preference``) against TRL's own preparation: the prompt, chosen and rejected
ids equal what ``DPOTrainer._prepare_dataset`` makes of the same records (plain, conversational, implicit
prompt), on the character tokenizer and the Open-Llama-like sentencepiece one; the static rows, the
truncation rule, and bad records (exit 2 naming file, record and fix)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from cli_runs import command_cli

from lowmem_tpu.config import DataSection, ModelSection
from lowmem_tpu.data import DataError, build_dataset, exact_match_prompts, set_chat_template
from lowmem_tpu.data.pairs import collate_pairs
from lowmem_tpu.model import load_tokenizer

USER = {"role": "user", "content": "reverse abc"}
PLAIN = [
    {"prompt": "reverse abc", "chosen": " cba", "rejected": " abc"},
    {"prompt": "reverse hello world", "chosen": " dlrow olleh", "rejected": " hello world"},
]
CONVERSATIONAL = [
    {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "cba"}],
        "rejected": [{"role": "assistant", "content": "bca"}],
    },
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse ab"}],
        "chosen": [{"role": "assistant", "content": "ba"}],
        "rejected": [{"role": "assistant", "content": "ab"}],
    },
]
IMPLICIT = [  # no prompt column: chosen and rejected share it (Anthropic HH, UltraFeedback's messages)
    {
        "chosen": [USER, {"role": "assistant", "content": "cba"}],
        "rejected": [USER, {"role": "assistant", "content": "acb"}],
    }
]
IMPLICIT_PLAIN = [{"chosen": "Q: reverse abc A: cba", "rejected": "Q: reverse abc A: bac"}]
TEXT_PROMPT_BESIDE = [  # HuggingFaceH4/ultrafeedback_binarized: a text prompt, conversations that hold it too
    {"prompt": USER["content"], **IMPLICIT[0]}
]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module", params=["tiny", "sentencepiece"])
def tok(request, model_dir):
    source = "builtin:tiny-llama" if request.param == "tiny" else str(model_dir)
    tokenizer = load_tokenizer(ModelSection(name_or_path=source, pad_token="<unk>"))
    set_chat_template(tokenizer, DataSection(format="preference"))
    return tokenizer


def _trl(tok, records, tmp_path) -> list[dict]:
    """TRL 1.16's own tokenization of the records (``DPOTrainer._prepare_dataset``, no trainer built; its
    wait for other processes and a DPOConfig, which would start XLA here, left out: one process)."""
    import contextlib

    import datasets
    import trl.trainer.dpo_trainer as dpo
    from trl import DPOTrainer

    dpo.global_then_local_main_first = contextlib.nullcontext
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")  # DPOConfig's
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tok), datasets.Dataset.from_list(records), tok, args, "t"
    )
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]


def _ours(rows) -> list[dict]:
    """The prompt, chosen and rejected ids back out of the static rows."""
    out = []
    for row in rows:
        (ids_c, ids_r), (mask_c, mask_r), (real_c, real_r) = (
            row["input_ids"],
            row["completion_mask"],
            row["attention_mask"],
        )
        start = mask_c.index(1)
        assert mask_r.index(1) == start and ids_c[:start] == ids_r[:start]
        out.append(
            {
                "prompt_ids": ids_c[:start],
                "chosen_ids": [t for t, m in zip(ids_c, mask_c, strict=True) if m],
                "rejected_ids": [t for t, m in zip(ids_r, mask_r, strict=True) if m],
            }
        )
        assert sum(real_c) == start + sum(mask_c) and sum(real_r) == start + sum(mask_r)  # padding: never trained
    return out


@pytest.mark.parametrize(
    "records",
    [PLAIN, CONVERSATIONAL, IMPLICIT, IMPLICIT_PLAIN, TEXT_PROMPT_BESIDE],
    ids=["plain", "chat", "implicit", "implicit-plain", "text-prompt-beside"],
)
def test_pairs_are_tokenized_as_trl_tokenizes_them(tok, records, tmp_path):
    cfg = DataSection(path=_write(tmp_path / "p.jsonl", records), format="preference", max_length=64)
    rows, stats = build_dataset(cfg, tok)
    assert stats["rows"] == len(records) and stats["truncated"] == 0
    # TRL's preparation takes a text prompt beside conversations as the whole prompt and fails: it is given
    # the conversations alone, which hold that prompt (what its maybe_extract_prompt makes of such records)
    assert _ours(rows) == _trl(tok, IMPLICIT if records is TEXT_PROMPT_BESIDE else records, tmp_path)
    assert all(len(ids) == 64 for row in rows for ids in row["input_ids"])


def test_a_batch_is_every_chosen_row_then_every_rejected_row(tok, tmp_path):
    cfg = DataSection(path=_write(tmp_path / "p.jsonl", PLAIN), format="preference", max_length=32)
    rows, _ = build_dataset(cfg, tok)
    batch = collate_pairs([rows[0], rows[1]])
    assert batch["input_ids"].shape == (4, 32)
    assert batch["input_ids"][1].tolist() == rows[1]["input_ids"][0]  # chosen of pair 2
    assert batch["input_ids"][2].tolist() == rows[0]["input_ids"][1]  # rejected of pair 1


def test_other_column_names_are_mapped(tok, tmp_path):
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PLAIN]
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    cfg = DataSection(path=_write(tmp_path / "p.jsonl", renamed), format="preference", columns=columns)
    assert _ours(build_dataset(cfg, tok)[0]) == _trl(tok, PLAIN, tmp_path)


def test_a_long_prompt_is_cut_from_the_left_and_keeps_its_first_token(tok, tmp_path):
    long = [{"prompt": "reverse " + "x" * 60 + " abc", "chosen": " cba", "rejected": " abc"}]
    path = _write(tmp_path / "p.jsonl", long)
    (full,) = _trl(tok, long, tmp_path)
    limit = len(full["prompt_ids"]) + len(full["chosen_ids"]) - 3  # 3 tokens too long
    rows, stats = build_dataset(DataSection(path=path, format="preference", max_length=limit), tok)
    (cut,) = _ours(rows)
    assert stats["truncated"] == 1
    assert cut["chosen_ids"] == full["chosen_ids"] and cut["rejected_ids"] == full["rejected_ids"]
    assert cut["prompt_ids"] == full["prompt_ids"][:1] + full["prompt_ids"][4:]
    with pytest.raises(DataError, match="drop"):  # every pair too long: nothing left, said so
        build_dataset(DataSection(path=path, format="preference", max_length=limit, too_long="drop"), tok)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"prompt": "p", "chosen": "a"}, "column 'rejected' .rejected. must be a non-empty string"),
        ({"prompt": "p", "chosen": " a", "rejected": " a"}, "chosen and rejected are the same"),
        ({"prompt": [USER], "chosen": "a", "rejected": "b"}, "must all be strings or all lists of messages"),
        ({"prompt": "reverse " + "x" * 80, "chosen": " a", "rejected": " b"}, "the prompt alone is"),
    ],
    ids=["no-rejected", "same", "mixed", "prompt-too-long"],
)
def test_bad_records_name_the_record_and_the_fix(tok, tmp_path, record, expected):
    path = _write(tmp_path / "bad.jsonl", [PLAIN[0], record])
    with pytest.raises(DataError, match=expected) as err:
        build_dataset(DataSection(path=path, format="preference", max_length=32), tok)
    assert "bad.jsonl" in str(err.value) and "record 2" in str(err.value)


def test_exact_match_expects_the_chosen_answer(tok, tmp_path):
    cfg = DataSection(path=_write(tmp_path / "p.jsonl", CONVERSATIONAL), format="preference")
    prompts = exact_match_prompts(cfg, tok, cfg.path, 2)
    assert [answer for _, answer in prompts] == ["cba", "ba"]
    rendered = tok.apply_chat_template(CONVERSATIONAL[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompts[0][0], skip_special_tokens=False).endswith(rendered.removeprefix(tok.bos_token or ""))


def test_sft_data_given_to_dpo_and_pairs_given_to_sft_exit_2(tmp_path):
    out = f"output_dir={tmp_path / 'run'}"
    sft_data = command_cli("dpo", "recipes/tiny_lora_cpu.yaml", out)
    assert sft_data.returncode == 2 and "data.format is chat" in sft_data.stderr and "Traceback" not in sft_data.stderr
    pairs = ["data.format=preference", "data.path=builtin:reverse/prefer_train.jsonl", out]
    pairs += ["data.eval_path=builtin:reverse/prefer_eval.jsonl"]
    given_to_sft = command_cli("sft", "recipes/tiny_lora_cpu.yaml", *pairs)
    assert given_to_sft.returncode == 2 and "lowmem-tpu dpo" in given_to_sft.stderr
    not_read = command_cli("orpo", "recipes/tiny_dpo_cpu.yaml", out)  # its loss_type is DPO's: named, with the fix
    assert not_read.returncode == 2 and "preference.loss_type=[sigmoid]" in not_read.stderr
    copy = ["lora.enabled=false", "preference.precompute_ref_log_probs=false"]  # a frozen copy: not made
    full = command_cli("dpo", "recipes/tiny_lora_cpu.yaml", *pairs, *copy)
    assert full.returncode == 2 and "a frozen copy of the whole model" in full.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["lora.init_lora_weights=pissa"], "would not be the model training starts from"),
        (["train.chunked_loss=true"], "TRL's LM head"),
        (["preference.loss_type=exo_pair", "preference.label_smoothing=0"], "needs it above 0"),
        (["data.packing=true"], "pairs are not packed"),
        (["preference.loss_type=[sigmoid,sft]", "preference.loss_weights=[1.0]"], "1 weight"),
        (["preference.loss_type=[sigmoid,apo_zero]", "preference.f_divergence_type=forward_kl"], "no form for"),
        (["preference.loss_type=hinge", "preference.use_weighting=true"], "backward fails"),
    ],
    ids=["pissa", "chunked-loss", "exo-pair", "packing", "loss-weights", "f-divergence", "wpo-hinge"],
)
def test_a_dpo_recipe_that_would_train_against_a_wrong_reference_or_crash_in_trl_is_refused(overrides, expected):
    from lowmem_tpu.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=expected):
        load_recipe("recipes/tiny_dpo_cpu.yaml", overrides)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["method=cpo", "preference.loss_type=exo_pair"], "method cpo takes one of sigmoid, hinge, ipo"),
        (["method=simpo", "preference.loss_type=[sigmoid]", "preference.beta=2"], None),
        (["method=dpo", "preference.simpo_gamma=1.0"], "preference.simpo_gamma: not read by method dpo"),
        (
            ["method=orpo", "preference.loss_type=[sigmoid]", "preference.label_smoothing=0.1"],
            "not read by method orpo",
        ),
        (["method=orpo", "preference.loss_type=[sigmoid]", "train.chunked_loss=true"], "TRL's LM head"),
    ],
    ids=["cpo-loss", "simpo", "dpo-simpo-field", "orpo-smoothing", "orpo-chunked"],
)
def test_each_method_reads_its_own_fields(overrides, expected):
    from lowmem_tpu.config import RecipeError, load_recipe

    if expected is None:
        assert load_recipe("recipes/tiny_dpo_cpu.yaml", overrides).method == "simpo"
        return
    with pytest.raises(RecipeError, match=expected):
        load_recipe("recipes/tiny_dpo_cpu.yaml", overrides)


def test_the_method_is_read_from_the_data_when_a_recipe_names_none_and_every_method_has_a_command():
    from lowmem_tpu.cli.train import METHOD_COMMANDS
    from lowmem_tpu.config import Recipe, load_recipe
    from lowmem_tpu.config.methods import METHODS

    tiny = {"model": {"random_init": True}}
    assert Recipe(**tiny).method == "sft" and Recipe(**tiny, data={"format": "preference"}).method == "dpo"
    assert load_recipe("recipes/tiny_lora_cpu.yaml", ["method=sft"]).method == "sft"
    assert list(METHOD_COMMANDS) == ["train", *METHODS]
