"""``export --gguf`` checked by the programs that run the files: transformers' GGUF reader and llama.cpp itself.

Each family's stand-in (its config.json shape, shrunk; its tokenizer kind) and the Open-Llama-shaped directory
(sentencepiece ``tokenizer.model``) is written as GGUF; llama.cpp (llama-cpp-python, in [dev]) must compute the
model's logits and tokenize as the model's tokenizer does, and answer greedily as transformers does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import make_family
from tiny_models import make_adapter, make_base

from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.gguf import llama_cpp
from lowmem_tpu.publish.gguf.export import REPORT, export_gguf, summary

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def assert_read_back(report: dict, types: tuple[str, ...], readers: tuple[str, ...] = ("transformers", "llama.cpp")):
    assert report["llama_cpp_checked"]
    assert sorted(f["type"] for f in report["files"].values()) == sorted(types)
    for name, entry in report["files"].items():
        assert set(entry["check"]) == set(readers)
        for reader in readers:
            check = entry["check"][reader]
            assert check["passed"] and check["relative_diff"] <= check["tolerance"], (name, reader, check)
        same, total = entry["check"]["llama.cpp"]["token_ids"].split("/")
        assert same == total and int(total) > 0, entry["check"]["llama.cpp"]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_multimodal", "phi4"])
def test_each_family_reads_back_in_transformers_and_llama_cpp(family, tmp_path):
    source = make_family(tmp_path / family, family)
    report = export_gguf(source, ["f32", "q8_0"], tmp_path / "out")
    assert_read_back(report, ("f32", "q8_0"))
    f32 = next(e for e in report["files"].values() if e["type"] == "f32")
    assert f32["check"]["transformers"]["relative_diff"] < 1e-5  # the same weights, summed in another order
    q8 = next(e for e in report["files"].values() if e["type"] == "q8_0")
    assert q8["tensor_types"].get("Q8_0", 0) > 0 and q8["bytes"] < f32["bytes"] / 3
    written = json.loads((tmp_path / "out" / REPORT).read_text())
    assert written["files"].keys() == report["files"].keys()
    assert (tmp_path / "out" / "MANIFEST.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a partial directory was left"


@pytest.mark.parametrize(
    ("family", "types"), [("gemma4", ("f32",)), ("gemma4_moe", ("f32",)), ("gpt_oss", ("f32", "q8_0"))]
)
def test_families_transformers_cannot_read_back_are_checked_by_llama_cpp(family, types, tmp_path):
    """Gemma 4 E2B's layout (layers of two kinds, K/V reused, per-layer embeddings) and 26B-A4B's (experts
    beside the dense MLP, K = V); gpt-oss from the Hub's MXFP4 checkpoint (sinks, biased experts split from
    their interleaved stack, yarn): the tensors as llama.cpp's converter writes them, llama.cpp's logits and
    token ids the model's. transformers' GGUF reader cannot build these models: the report says so."""
    report = export_gguf(make_family(tmp_path / family, family), list(types), tmp_path / "out")
    assert_read_back(report, types, readers=("llama.cpp",))
    for entry in report["files"].values():
        assert "llama.cpp alone checked it" in " ".join(entry["notes"])
        assert entry["check"]["llama.cpp"]["chat_token_ids"] == "same"


def test_open_llama_shaped_sentencepiece_directory(tmp_path):
    from open_llama_like import build

    source = build(tmp_path / "open_llama")
    report = export_gguf(source, ["f16", "q8_0"], tmp_path / "out")
    assert_read_back(report, ("f16", "q8_0"))
    assert {e["tokenizer"] for e in report["files"].values()} == {"sentencepiece (tokenizer.model)"}


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_window_llama_cpp_would_ignore_is_caught_and_nothing_is_written(family, tmp_path):
    source = make_family(tmp_path / family, family)  # their stand-ins attend over 7-8 tokens: fewer than the prompts
    with pytest.raises(UserError, match=r"a window of \d tokens") as err:
        export_gguf(source, ["f32"], tmp_path / "out")
    assert "nothing was written" in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mistral_without_a_window_exports(tmp_path):
    source = make_family(tmp_path / "mistral", "mistral")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sliding_window": None}))  # Mistral 7B v0.3's
    assert_read_back(export_gguf(source, ["f16"], tmp_path / "out"), ("f16",))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-adapter")
    return make_adapter(make_base(root / "base"), root / "adapter")


def test_an_adapter_is_merged_exported_and_answers_greedily_as_transformers_does(adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gguf"
    result = cli("export", str(adapter), "--gguf", "f32,q8_0", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vLLM loads the adapter" in result.stdout and "--max-lora-rank 8" in result.stdout
    report = json.loads((out / REPORT).read_text())
    assert report["kind"] == "adapter" and report["merged"]
    assert_read_back(report, ("f32", "q8_0"))
    assert not [p for p in tmp_path.iterdir() if p.name != "gguf"], "the merged scratch copy was left"

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(adapter.parent / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    runner = llama_cpp.load(out / next(n for n in report["files"] if "F32" in n), 64)
    for text in ("reverse abcde", "reverse hello"):
        ids = tokenizer(text)["input_ids"]
        ours = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        theirs = []
        for token in runner.generate(ids, temp=0.0, top_k=1, reset=True):
            if len(theirs) == len(ours):
                break
            theirs.append(token)
        assert theirs == ours, (text, theirs, ours)
    runner.close()


def test_without_llama_cpp_transformers_alone_checks_and_the_summary_says_so(adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "available", lambda: False)
    report = export_gguf(adapter, ["f16"], tmp_path / "out")
    entry = next(iter(report["files"].values()))
    assert list(entry["check"]) == ["transformers"] and entry["check"]["transformers"]["passed"]
    assert not report["llama_cpp_checked"]
    assert "pip install -c constraints.txt -e '.[gguf]'" in summary(report, tmp_path / "out")


def test_bad_input_exits_2_naming_the_fix_and_writes_nothing(adapter, tmp_path):
    unknown = cli("export", str(adapter), "--gguf", "q4_k_m", "--out", str(tmp_path / "a"))
    assert unknown.returncode == 2 and "choose from f32, f16, bf16, q8_0" in unknown.stderr
    run = tmp_path / "run"
    (run / "checkpoints" / "step-10").mkdir(parents=True)
    unfinished = cli("export", str(run), "--gguf", "f16")
    assert unfinished.returncode == 2 and "has not finished" in unfinished.stderr
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    family = cli("export", str(tmp_path / "gpt2"), "--gguf", "f16", "--out", str(tmp_path / "b"))
    assert family.returncode == 2 and "does not describe the model type 'gpt2'" in family.stderr
    for result in (unknown, unfinished, family):
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
