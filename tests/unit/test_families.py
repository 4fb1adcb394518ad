"""The families people fine-tune, each against transformers itself: the base as ``from_pretrained`` loads it,
LoRA on each family's own projections, the decoder layer that sharding wraps, and what the recipe and the
planner refuse or offer per family (chunked attention against eager on the XLA devices: e2e/test_family_attention.py).
The stand-ins (``stand_ins``, tests/conftest.py) are each family's config shrunk, with random weights."""

from __future__ import annotations

import pytest
import torch
from families import ALL_NAMES, WINDOW
from transformers import AutoModelForCausalLM

from lowmem_tpu.config import ModelSection, load_recipe
from lowmem_tpu.config.model_fields import LORA_TARGETS
from lowmem_tpu.errors import UserError
from lowmem_tpu.model import build_base_model, layer_class
from lowmem_tpu.model.architecture import check_model, lora_targets

ALL = ALL_NAMES


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_base_equals_from_pretrained(stand_ins, name, dtype):
    reference = AutoModelForCausalLM.from_pretrained(stand_ins[name], dtype=getattr(torch, dtype))
    ours = build_base_model(ModelSection(name_or_path=str(stand_ins[name]), dtype=dtype))
    assert type(ours) is type(reference)
    expected = {**reference.state_dict(), **dict(reference.named_buffers())}
    got = {**ours.state_dict(), **dict(ours.named_buffers())}
    assert expected.keys() == got.keys()
    different = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not different, different
    assert ours.generation_config.eos_token_id == reference.generation_config.eos_token_id


@pytest.mark.parametrize(
    ("name", "key", "missing"),
    [
        ("gemma2", "model.embed_tokens.weight", r"1 parameters.*embed_tokens"),  # the LM head is tied to it
        ("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight", r"1 parameters.*layers\.1\.mlp\.experts\.gate_up"),
    ],
)
def test_a_checkpoint_missing_a_weight_is_refused(stand_ins, tmp_path, name, key, missing):
    """A missing tensor, or one expert of the Hub's one key per expert, is named, never initialised."""
    from safetensors.torch import load_file, save_file

    source = stand_ins[name]
    broken = tmp_path / name
    broken.mkdir()
    for item in source.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    del tensors[key]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"lacks weights for {missing}"):
        build_base_model(ModelSection(name_or_path=str(broken), dtype="float32"))


LAYERS = {
    "llama3": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma3": "Gemma3DecoderLayer",
    "mistral": "MistralDecoderLayer",
    "phi3": "Phi3DecoderLayer",
    "phi4": "Phi3DecoderLayer",
    "gemma3_multimodal": "Gemma3DecoderLayer",  # not SiglipEncoderLayer, which _no_split_modules also names
    "gemma4": "Gemma4TextDecoderLayer",
    "gemma4_moe": "Gemma4TextDecoderLayer",
    "gpt_oss": "GptOssDecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer",
}


@pytest.mark.parametrize("name", ALL)
def test_the_wrapped_layer_is_the_text_decoders(stand_ins, name):
    model = build_base_model(ModelSection(name_or_path=str(stand_ins[name]), dtype="float32"), weights="meta")
    assert layer_class(model, None).__name__ == LAYERS[name]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3", "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"),
        ("phi3", "qkv_proj o_proj gate_up_proj down_proj"),
        ("phi4", "qkv_proj o_proj gate_up_proj down_proj"),
    ],
)
def test_default_lora_targets_follow_the_projections(stand_ins, name, expected):
    from lowmem_tpu.model import apply_lora

    default = f"lora.target_modules=[{','.join(LORA_TARGETS)}]"  # the schema's default, what open_llama_lora lists
    recipe = load_recipe(None, [f"model.name_or_path={stand_ins[name]}", default])
    model = apply_lora(build_base_model(recipe.model, weights="random"), recipe)
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == set(expected.split())


@pytest.mark.parametrize("name", ["gemma3_multimodal", "gemma4"])
def test_lora_on_the_multimodal_gemma_adapts_the_text_decoder_only(stand_ins, name):
    from lowmem_tpu.model import apply_lora

    for targets in ("all-linear", "[q_proj,v_proj]"):
        recipe = load_recipe(None, [f"model.name_or_path={stand_ins[name]}", f"lora.target_modules={targets}"])
        model = apply_lora(build_base_model(recipe.model, weights="random"), recipe)
        adapted = [n for n, _ in model.named_parameters() if "lora_A" in n]
        assert adapted and all(".language_model.layers." in n for n in adapted), targets


def test_the_chunked_loss_is_refused_for_soft_capped_logits(stand_ins):
    recipe = load_recipe(None, [f"model.name_or_path={stand_ins['gemma2']}", "train.chunked_loss=true"])
    with pytest.raises(UserError, match=r"train.chunked_loss: gemma2 scales or soft-caps its logits"):
        check_model(recipe)


def test_a_target_that_matches_nothing_is_refused_by_validate(stand_ins):
    recipe = load_recipe(None, [f"model.name_or_path={stand_ins['phi3']}", "lora.target_modules=[q_proj,o_proj]"])
    with pytest.raises(
        UserError, match=r"q_proj matches no module.*projections are o_proj, qkv_proj, gate_up_proj, down_proj"
    ):
        check_model(recipe)
    assert lora_targets(build_base_model(recipe.model, weights="meta"), ["o_proj"]) == ["o_proj"]


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral", "phi3"])
def test_flash_is_refused_where_the_model_windows_or_caps_attention(stand_ins, name):
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config

    overrides = [f"model.name_or_path={stand_ins[name]}", "model.attn_implementation=flash", "runtime.target=v5e-8"]
    recipe = load_recipe(None, [*overrides, "runtime.device=tpu", "data.max_length=512"])
    with pytest.raises(UserError, match=r"flash \(torch_xla's Pallas kernel\) has no sliding windows.*use chunked"):
        check_model(recipe)
    with pytest.raises(UserError, match=r"has no sliding windows"):
        plan_recipe(recipe, "v5e-8", require_config(recipe))


REAL_SIZE = {  # hidden, intermediate, layers, vocab: Gemma 2 9B, Mistral 7B, Qwen 2.5 7B, Llama 3.1 8B
    "gemma2": (3584, 14336, 42, 256000),
    "mistral": (4096, 14336, 32, 32000),
    "qwen2": (3584, 18944, 28, 152064),
    "llama3": (4096, 14336, 32, 128256),
}


@pytest.mark.parametrize(("name", "flash"), [("gemma2", False), ("mistral", False), ("qwen2", True), ("llama3", True)])
def test_the_advisor_offers_flash_only_where_it_computes_the_model(tmp_path, name, flash):
    import json

    from families import family_config

    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config

    hidden, intermediate, layers, vocab = REAL_SIZE[name]
    config = family_config(name) | {"hidden_size": hidden, "intermediate_size": intermediate}
    config |= {"num_hidden_layers": layers, "vocab_size": vocab, "num_attention_heads": 32, "head_dim": 128}
    config |= {"sliding_window": 4096} if config.get("sliding_window") == WINDOW else {}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows = ["data.max_length=8192", "train.global_batch_size=1", "runtime.num_cpu_devices=1", "runtime.target=v5e-1"]
    rows += ["sharding.activation_checkpointing=false"]
    recipe = load_recipe(None, [f"model.name_or_path={tmp_path}", "model.random_init=true", *rows])
    overrides = [step.override for step in plan_recipe(recipe, "v5e-1", require_config(recipe)).steps]
    offered = "model.attn_implementation=flash" in overrides
    assert offered or not flash, overrides
    if offered and not flash:  # a window of 4096 keys: flash only once the rows are no longer than it
        shorter = [o for o in overrides[: overrides.index("model.attn_implementation=flash")] if "max_length" in o]
        assert name != "gemma2" and shorter and int(shorter[-1].split("=")[1]) <= 4096, overrides
    if name == "gemma2":  # soft-capped logits: the chunked loss does not compute them
        assert "train.chunked_loss=true" not in overrides, overrides


def test_every_end_of_text_id_the_model_lists_is_kept(stand_ins):
    from transformers import AutoTokenizer

    from lowmem_tpu.config.assets import ASSETS
    from lowmem_tpu.model import align_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    model = build_base_model(ModelSection(name_or_path=str(stand_ins["llama3"]), dtype="float32"))
    align_special_tokens(model, tokenizer)
    assert tokenizer.eos_token_id == 2 and model.generation_config.eos_token_id == [2, 3, 4]
    assert model.config.eos_token_id == [2, 3, 4]


def test_the_planner_reads_gemmas_tied_head_and_phis_fused_projections(stand_ins):
    from lowmem_tpu.memory.shape import setting_of, shape_of
    from lowmem_tpu.model.build import require_config

    for name, tied in (("gemma2", True), ("gemma3_multimodal", True), ("mistral", False)):
        recipe = load_recipe(None, [f"model.name_or_path={stand_ins[name]}"])
        assert shape_of(require_config(recipe)).tied is tied, name  # Gemma's config.json leaves it out
    fused = "lora.target_modules=[qkv_proj,o_proj,gate_up_proj,down_proj]"
    recipe = load_recipe(None, [f"model.name_or_path={stand_ins['phi3']}", fused])
    assert set(setting_of(recipe, 4).targets) == set(LORA_TARGETS)


def test_the_vision_tower_is_counted_as_weights_a_text_step_never_reads(stand_ins):
    """Gemma 3 4B+ trained as text: ``memory --compile`` counts the vision tower's weights beside the step's
    program (in HBM, no argument of it); every weight the text forward reads is an argument."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_tpu.measure.child import _idle_weights

    model = AutoModelForCausalLM.from_pretrained(stand_ins["gemma3_multimodal"], dtype=torch.float32)
    idle = _idle_weights(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[2, 5, 9, 12]]))
    names = {id(p): n for n, p in model.named_parameters()}
    idle_names = {names[id(p)] for p in idle()}
    outside_text = {n for n in names.values() if "vision_tower" in n or "multi_modal_projector" in n}
    assert idle_names == outside_text and outside_text


def test_the_adapters_are_drawn_from_the_recipes_seed_on_a_loaded_base(stand_ins):
    """A base read from a checkpoint draws nothing: unless the builder seeds, LoRA's A matrices would differ
    between two runs of one recipe, between the hosts of a pod slice, and after a resume."""
    import torch

    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.model import apply_lora, build_base_model

    recipe = load_recipe("recipes/tiny_lora_cpu.yaml", [f"model.name_or_path={stand_ins['llama3']}"])
    model = recipe.model.model_copy(update={"random_init": False})
    drawn = []
    for noise in (1, 2):
        torch.manual_seed(noise)  # whatever ran before
        adapters = apply_lora(build_base_model(model, recipe.train.seed), recipe).state_dict()
        drawn.append({k: v for k, v in adapters.items() if "lora_A" in k})
    assert drawn[0] and all(torch.equal(drawn[0][k], drawn[1][k]) for k in drawn[0])


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_lora_dtype_model_puts_every_adapter_in_the_bases_dtype_with_fp32_masters(quantize):
    from lowmem_tpu.config.schema import uses_master_weights
    from lowmem_tpu.model import apply_lora

    bf16 = ["model.name_or_path=builtin:tiny-llama", "model.random_init=true", "model.dtype=bfloat16"]
    recipe = load_recipe(None, [*bf16, f"model.quantize={quantize}"])
    adapters = {
        p.dtype
        for n, p in apply_lora(build_base_model(recipe.model, weights="random"), recipe).named_parameters()
        if ".lora_" in n
    }
    assert adapters == {torch.float32} and not uses_master_weights(recipe)  # PEFT's default: fp32 adapters
    recipe = load_recipe(None, [*bf16, f"model.quantize={quantize}", "lora.dtype=model"])
    model = apply_lora(build_base_model(recipe.model, weights="random"), recipe)
    adapters = {p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert adapters == {torch.bfloat16} and uses_master_weights(recipe)  # a quantized base's too


def test_gemma4s_layers_are_planned_one_by_one_and_cut_with_their_share_of_kv_reuse(stand_ins, tmp_path):
    """Gemma 4's layers differ (full layers' wider heads, no k/v projections and a double-wide MLP where K/V is
    reused, per-layer embeddings, 26B-A4B's experts beside the dense MLP): the planner's count equals the meta
    model's (towers included), in full and with all-linear LoRA (the PLE projections adapted too), for the
    stand-ins and E2B; the TPU compile's cut keeps E2B's share of reusing layers (14 and 28 of 35) and
    builds; a scan is refused."""

    from lowmem_tpu.measure.tpu_layers import cut, layer_points
    from lowmem_tpu.memory.plan import parameters
    from lowmem_tpu.memory.shape import setting_of, shape_of
    from lowmem_tpu.model import apply_lora, count_parameters
    from lowmem_tpu.model.build import meta_model, require_config

    full, lora = ["lora.enabled=false"], ["lora.target_modules=all-linear"]
    cases = ((stand_ins["gemma4"], None, (full, lora)), ("google/gemma-4-E2B-it", 4_628_569_344, (lora,)))
    for name, text, ways in (*cases, (stand_ins["gemma4_moe"], None, (full, lora))):
        for way in ways:
            recipe = load_recipe(None, [f"model.name_or_path={name}", *way])
            config = require_config(recipe)  # as the commands read it
            model = meta_model(config)  # the towers planned as frozen weights beside the decoder
            decoder = sum(p.numel() for p in model.model.language_model.parameters())
            trainable, total = count_parameters(apply_lora(model, recipe, weightless=True))
            planned = parameters(shape_of(config), setting_of(recipe, 1))
            assert sum(t.parameters for t in planned) == total and decoder == (text or decoder)
            assert not recipe.lora.enabled or sum(t.parameters for t in planned if t.trainable) == trainable
    recipe = load_recipe("recipes/gemma4_e2b_lora_v5e1.yaml", [])
    assert layer_points(recipe) == (14, 28)
    for layers, reused in ((14, 8), (28, 16)):
        small = require_config(cut(recipe, layers, tmp_path))
        text = small.text_config
        assert (text.num_hidden_layers, text.num_kv_shared_layers) == (layers, reused)
        model = meta_model(small)
        assert sum(isinstance(m, layer_class(model, None)) for m in model.modules()) == layers
    scanned = load_recipe(None, [f"model.name_or_path={stand_ins['gemma4']}", "sharding.scan_layers=true"])
    with pytest.raises(UserError, match="layers differ in shape"):
        check_model(scanned)
