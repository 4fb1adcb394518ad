"""Chat as each family defines it, on its own tokenizer kind and template (``family_tokenizers``): every
assistant turn of a multi-turn conversation trained with its end of turn and nothing else, the saved
template reproducing the rows, replies ending at the family's end of turn, exact match expecting what
training taught. No XLA."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from families import family_config
from family_tokenizers import END_OF_TURN, SPECS, make_tokenizer
from open_llama_like import build

from lowmem_tpu.config import DataSection, ModelSection
from lowmem_tpu.data import IGNORE_INDEX, build_dataset, exact_match_prompts, set_chat_template
from lowmem_tpu.data.chat import ending, reply_text
from lowmem_tpu.model import load_tokenizer, save_tokenizer

NAMES = tuple(END_OF_TURN)
CONVERSATION = [
    {"role": "system", "content": "You reverse words."},
    {"role": "user", "content": "Reverse lemon."},
    {"role": "assistant", "content": "nomel"},
    {"role": "user", "content": "And again?"},
    {"role": "assistant", "content": "lemon"},
]


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory) -> tuple[str, object, Path]:
    """(name, the tokenizer as sft prepares it, a chat data file)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    make_tokenizer(root / "tokenizer", name)
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(root / "tokenizer")))
    set_chat_template(tokenizer, DataSection(format="chat"))
    data = root / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    return name, tokenizer, data


def runs(row: dict) -> list[list[int]]:
    """The trained labels of a row as runs of consecutive positions."""
    out: list[list[int]] = []
    previous = -2
    for i, label in enumerate(row["labels"]):
        if label == IGNORE_INDEX:
            continue
        if i != previous + 1:
            out.append([])
        out[-1].append(label)
        previous = i
    return out


def test_every_assistant_turn_is_trained_in_context_with_its_end_of_turn(family):
    name, tokenizer, data = family
    rows, stats = build_dataset(DataSection(path=str(data), format="chat", max_length=128), tokenizer)
    turns = [tokenizer.decode(run) for run in runs(rows[0])]
    after_last_user = "<think>\n\n</think>\n\n" if name.startswith("qwen3") else ""  # Qwen 3: that turn only
    last_end = END_OF_TURN[name] + ("<|endoftext|>" if name == "phi3" else "")  # Phi-3's EOS after the last one
    # gpt-oss: a reply in the final channel; the last ends with <|return|>, the one a model emits, an earlier
    # one with <|end|>, which the model never emits (and so is not trained)
    channel, first_end = ("<|channel|>final<|message|>", "") if name == "gpt_oss" else ("", END_OF_TURN[name])
    expected = [f"{channel}nomel{first_end}", f"{channel}{after_last_user}lemon{last_end}"]
    assert [turn.lstrip() for turn in turns] == expected
    assert stats["trained_tokens"] == sum(len(run) for run in runs(rows[0]))


def test_rows_start_with_bos_exactly_where_the_tokenizer_puts_it(family):
    name, tokenizer, data = family
    rows, _ = build_dataset(DataSection(path=str(data), format="chat", max_length=128), tokenizer)
    ids = rows[0]["input_ids"]
    writes = tokenizer.apply_chat_template(CONVERSATION, tokenize=False).startswith(str(tokenizer.bos_token))
    if SPECS[name].adds_bos or writes:  # the tokenizer puts it, or the template writes it (Gemma 4)
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    else:
        assert tokenizer.bos_token_id not in ids[:2]


def test_the_saved_template_renders_the_training_rows(family, tmp_path):
    """What serving does with the saved directory (render the conversation before the last reply with the
    generation prompt, tokenize it as it is) gives the very tokens trained on, the reply after them."""
    name, tokenizer, data = family
    rows, _ = build_dataset(DataSection(path=str(data), format="chat", max_length=128), tokenizer)
    save_tokenizer(tokenizer, tmp_path)
    served = load_tokenizer(ModelSection(name_or_path=str(tmp_path)))
    ids = served.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
    real = [t for t, m in zip(rows[0]["input_ids"], rows[0]["attention_mask"], strict=True) if m]
    assert real[: len(ids)] == list(ids)
    reply = served.decode(real[len(ids) :])
    reply = reply.removeprefix("<think>\n\n</think>\n\n").removeprefix("<|channel|>final<|message|>")
    assert reply.lstrip().startswith("lemon" + END_OF_TURN[name])


def test_replies_stop_at_the_end_of_turn(family):
    name, tokenizer, _ = family
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=family_config(name)["eos_token_id"]))
    end = ending(tokenizer, model)
    first = tokenizer(END_OF_TURN[name], add_special_tokens=False)["input_ids"][0]
    assert first in end.ids and tokenizer.eos_token_id in end.ids
    assert end.text == ""  # a single special token: decoding stops on it, nothing is left to cut
    assert end.cut([7, 8, first, 9]) == [7, 8]


def test_exact_match_expects_what_training_taught(family):
    name, tokenizer, data = family
    [(ids, answer)] = exact_match_prompts(DataSection(path=str(data), format="chat"), tokenizer, str(data), 1)
    expected = {"qwen3": "<think>\n\n</think>\n\nlemon", "qwen3_moe": "<think>\n\n</think>\n\nlemon"}
    assert answer.strip() == expected.get(name, "lemon")  # as a reply is read (gpt-oss: its final channel)
    rows, _ = build_dataset(DataSection(path=str(data), format="chat", max_length=128), tokenizer)
    assert rows[0]["input_ids"][: len(ids)] == ids  # the prompt is the trained row's own beginning


def test_chatml_on_a_tokenizer_without_its_markers_ends_replies_cleanly(tmp_path):
    """Open Llama has no <|im_end|> token: the reply's literal end-of-turn text is cut, and EOS stops it."""
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(build(tmp_path)), pad_token="<unk>"))
    set_chat_template(tokenizer, DataSection(format="chat", chat_template="chatml"))
    end = ending(tokenizer)
    assert end.ids == (tokenizer.eos_token_id,) and end.text == "<|im_end|>"
    reply = tokenizer.decode(tokenizer("nomel<|im_end|>", add_special_tokens=False)["input_ids"])
    assert end.clean(reply) == "nomel"


def test_a_text_that_ends_with_eos_gets_no_second_one(tmp_path):
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(build(tmp_path / "model")), pad_token="<unk>"))
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"text": "hello there</s>"}) + "\n" + json.dumps({"text": "hello there"}) + "\n")
    rows, _ = build_dataset(DataSection(path=str(data), format="text", max_length=32), tokenizer)
    ended = [[t for t, m in zip(r["input_ids"], r["attention_mask"], strict=True) if m] for r in rows]
    assert ended[0] == ended[1] and ended[0][-1] == tokenizer.eos_token_id and ended[0][-2] != tokenizer.eos_token_id


def test_qwen3_turns_equal_transformers_generation_mask(tmp_path):
    """The reference: the same template with ``{% generation %}`` markers around what the model writes, and
    transformers' own ``return_assistant_tokens_mask``."""
    from family_tokenizers import QWEN3

    marked = QWEN3.replace(
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}",
        "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- '<think>\\n\\n</think>\\n\\n' + content + "
        "'<|im_end|>\\n' }}{% endgeneration %}",
    ).replace(
        "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}",
        "{%- else %}{{- '<|im_start|>assistant\\n' }}{% generation %}{{- content + '<|im_end|>\\n' }}"
        "{% endgeneration %}",
    )
    assert marked.count("{% generation %}") == 2
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(make_tokenizer(tmp_path / "tok", "qwen3"))))
    data = tmp_path / "chat.jsonl"
    conversation = [*CONVERSATION, {"role": "user", "content": "Once more?"}, {"role": "assistant", "content": "x"}]
    data.write_text(json.dumps({"messages": conversation}) + "\n")
    rows, _ = build_dataset(DataSection(path=str(data), format="chat", max_length=128), tokenizer)
    reference = tokenizer.apply_chat_template(
        conversation, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True
    )
    real = sum(rows[0]["attention_mask"])
    assert rows[0]["input_ids"][:real] == list(reference["input_ids"])
    assert [label != IGNORE_INDEX for label in rows[0]["labels"][:real]] == [
        bool(m) for m in reference["assistant_masks"]
    ]


def test_a_reply_reads_as_its_final_channel_where_the_template_has_channels(family):
    """gpt-oss replies in harmony: its analysis, then the final channel, which is the reply; elsewhere a reply
    is its text without special tokens."""
    name, tokenizer, _ = family
    if name == "gpt_oss":
        said = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>lemon"
    else:
        said = "lemon" + END_OF_TURN[name]
    ids = tokenizer(said, add_special_tokens=False)["input_ids"]
    assert reply_text(tokenizer, ids).strip() == "lemon"
