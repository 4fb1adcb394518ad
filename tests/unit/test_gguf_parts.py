"""The parts of GGUF export, vLLM's adapter rules and lm-eval's task files that need no model: each against its
reference (transformers' GGUF reader and rotary init, the tokenizers library, lm-eval's task loader)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_runs import command_cli
from safetensors.torch import save_file

from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.gguf.export import default_out, parse_types, resolve_source
from lowmem_tpu.publish.gguf.metadata import _llama3_factors, family_of
from lowmem_tpu.publish.gguf.vocab import GPT2_PRE, PRE_TOKENIZERS, SPACE, _pre_tokenizer, read_vocab
from lowmem_tpu.publish.gguf.writer import _interleave_rotary_halves, hf_name, stored
from lowmem_tpu.publish.vllm import max_lora_rank, vllm_problems

TINY = Path(__file__).resolve().parents[2] / "lowmem_tpu" / "assets" / "tiny-llama"


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_rotary_interleave_is_what_transformers_gguf_reader_undoes(heads, kv_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    undo = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    q = np.random.default_rng(0).normal(size=(heads * 16, 64)).astype(np.float32)
    k = np.random.default_rng(1).normal(size=(kv_heads * 16, 64)).astype(np.float32)
    assert np.array_equal(undo.process(_interleave_rotary_halves(q, heads), "blk.0.attn_q.weight").weights, q)
    assert np.array_equal(undo.process(_interleave_rotary_halves(k, kv_heads), "blk.0.attn_k.weight").weights, k)
    assert not np.array_equal(_interleave_rotary_halves(q, heads), q)


def test_llama3_rotary_factors_are_transformers_own_scaling():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    factors = _llama3_factors(rope, 128)
    assert np.allclose(factors, (plain / scaled.double()).numpy(), rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 32.0  # short wavelengths kept, long ones divided


def test_types_and_refusals():
    assert parse_types("F16, q8_0,f16") == ["f16", "q8_0"]
    with pytest.raises(UserError, match="unknown type q4_k_m; choose from f32, f16, bf16, q8_0"):
        parse_types("q4_k_m")
    with pytest.raises(UserError, match="does not describe the model type 'gpt_neox'"):
        family_of(SimpleNamespace(model_type="gpt_neox"))


def test_stored_types_follow_llama_cpps_rules():
    from gguf import GGMLQuantizationType as Q

    q, norm, router = "blk.0.attn_q.weight", "blk.0.attn_norm.weight", "blk.0.ffn_gate_inp.weight"
    assert stored(norm, np.ones(64, np.float32), "q8_0")[1] == Q.F32  # norms and biases stay float32
    data, qtype = stored(q, np.ones((4, 64), np.float32), "q8_0")
    assert qtype == Q.Q8_0 and data.dtype == np.uint8 and data.shape == (4, 2 * 34)  # 2 blocks of 32: scale + 32 int8
    assert stored(q, np.ones((4, 172), np.float32), "q8_0")[1] == Q.F16  # rows off the 32-block fall back
    assert stored(q, np.ones((4, 64), np.float32), "bf16")[1] == Q.BF16
    assert stored(router, np.ones((4, 64), np.float32), "q8_0")[1] == Q.F32  # a MoE router's exact scores


def test_a_multimodal_wrappers_text_model_is_unwrapped():
    assert hf_name("model.language_model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("language_model.model.norm.weight") == "model.norm.weight"
    assert hf_name("model.vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert hf_name("lm_head.weight") == "lm_head.weight"


def test_the_demo_character_vocabulary_becomes_sentencepiece_pieces():
    from transformers import AutoTokenizer

    vocab = read_vocab(TINY, AutoTokenizer.from_pretrained(TINY), 48)
    assert vocab.model == "llama" and vocab.add_space_prefix is False
    assert vocab.tokens[41] == SPACE and vocab.tokens[5] == "a" and vocab.tokens[3] == "<|user|>"
    assert vocab.types[3] == 3 and vocab.types[0] == 2  # <|user|> is control, <unk> unknown
    with pytest.raises(UserError, match="has 48 tokens but the model 40 embedding rows"):
        read_vocab(TINY, AutoTokenizer.from_pretrained(TINY), 40)


def _byte_level(tmp_path: Path, pre_tokenizer) -> Path:
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoders.ByteLevel()
    tok.train_from_iterator(["hello world, hello there"] * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    return tmp_path


def test_byte_level_pre_tokenizers_are_named_as_llama_cpp_names_them(tmp_path):
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    plain = _byte_level(tmp_path / "gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False))
    vocab = read_vocab(plain, AutoTokenizer.from_pretrained(plain), 400)
    assert (vocab.model, vocab.pre) == ("gpt2", GPT2_PRE) and vocab.merges and " " in vocab.merges[0]
    assert vocab.tokens[300:] == [f"[PAD{i}]" for i in range(300, 400)] and set(vocab.types[300:]) == {5}
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS["llama-bpe"]), behavior="isolated")
    llama3 = _byte_level(
        tmp_path / "llama3", pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)])
    )
    assert read_vocab(llama3, AutoTokenizer.from_pretrained(llama3), 300).pre == "llama-bpe"
    spec = json.loads((llama3 / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    with pytest.raises(UserError, match=r"a pattern llama\.cpp has no name for"):
        _pre_tokenizer(spec)


def _adapter(path: Path, config: dict, keys: list[str]) -> Path:
    path.mkdir(parents=True)
    base = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**base, "base_model_name_or_path": "b", **config}))
    save_file({key: torch.zeros(2, 2) for key in keys}, path / "adapter_model.safetensors")
    return path


def test_vllm_rules(tmp_path):
    layer = "base_model.model.model.layers.0.self_attn"
    good = [f"{layer}.q_proj.lora_A.weight", f"{layer}.q_proj.lora_B.weight", f"{layer}.v_proj.lora_A.weight"]
    assert vllm_problems(_adapter(tmp_path / "good", {}, good)) == []
    assert max_lora_rank(tmp_path / "good") == 16
    assert max_lora_rank(_adapter(tmp_path / "r4", {"r": 4}, good)) == 8
    dora = _adapter(tmp_path / "dora", {"use_dora": True}, [*good, f"{layer}.q_proj.lora_magnitude_vector"])
    problems = " | ".join(vllm_problems(dora))
    assert "DoRA (use_dora: true)" in problems and "not a LoRA A/B weight" in problems
    pissa = _adapter(tmp_path / "pissa", {"init_lora_weights": "pissa", "modules_to_save": ["lm_head"]}, good)
    problems = " | ".join(vllm_problems(pissa))
    assert "init_lora_weights: pissa" in problems and "modules_to_save" in problems
    router = _adapter(tmp_path / "router", {}, ["base_model.model.model.layers.0.mlp.router.lora_A.weight"])
    assert "LoRA on router" in vllm_problems(router)[0]


def test_an_unfinished_run_or_a_checkpoint_is_refused_with_the_fix(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    with pytest.raises(UserError, match=r"has not finished .*\(lowmem-tpu export .*checkpoints/step-N"):
        resolve_source(run)
    step = run / "checkpoints" / "step-4"
    (step / "COMPLETE").write_text("")
    (step / "state").mkdir()
    with pytest.raises(UserError, match="is a training checkpoint"):
        resolve_source(step)
    with pytest.raises(UserError, match="no such directory"):
        resolve_source(tmp_path / "missing")
    assert default_out(Path(".")).name == f"{Path.cwd().name}-gguf"  # the working directory has a name


def test_builtin_lm_eval_tasks_load_in_lm_evals_task_manager(tmp_path):
    from lm_eval.tasks import TaskManager

    from lowmem_tpu.infer.harness import BUILTIN_TASKS, parse_tasks, write_builtin_tasks

    assert parse_tasks("builtin:reverse, hellaswag") == [*BUILTIN_TASKS, "hellaswag"]
    manager = TaskManager(include_path=str(write_builtin_tasks(tmp_path)))
    tasks = manager.load_task_or_group(list(BUILTIN_TASKS))
    docs = list(tasks["reverse_choice"].test_docs())
    assert len(docs) == 200 and docs[0]["choices"][0] == docs[0]["answer"] == docs[0]["word"][::-1]


def test_cli_refuses_an_unknown_gguf_type_before_loading_anything(tmp_path):
    result = command_cli("export", str(tmp_path), "--gguf", "q3_k")
    assert result.returncode == 2 and "choose from f32, f16, bf16, q8_0" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_vllm_check_exits_2_naming_what_vllm_refuses(tmp_path):
    layer = "base_model.model.model.layers.0.self_attn"
    dora = _adapter(tmp_path / "dora", {"use_dora": True}, [f"{layer}.q_proj.lora_A.weight"])
    result = command_cli("export", str(dora), "--vllm")
    assert result.returncode == 2 and "vLLM would refuse the adapter" in result.stdout
    assert "DoRA (use_dora: true)" in result.stdout and "Traceback" not in result.stderr
