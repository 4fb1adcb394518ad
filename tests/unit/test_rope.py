"""Rotary embeddings by a matmul (``model.rope``) against each family's own ``rotate_half`` and forward pass:
the same values in bfloat16 (``torch.equal``), on the stand-ins of every family (tests/helpers/families.py),
PEFT-wrapped as a run wraps them."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from families import ALL_NAMES
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lowmem_tpu.model.architecture import lora_targets
from lowmem_tpu.model.rope import _ORIGINAL, by_matmul, rotation, use_matmul_rotation

ALL = ALL_NAMES


def _standard(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.fixture
def restore_rotations():
    """Each module swapped during the test gets its own ``rotate_half`` back."""
    yield
    for module in list(sys.modules.values()):
        original = getattr(module, _ORIGINAL, None) if module is not None else None
        if original is not None:
            module.rotate_half = original
            delattr(module, _ORIGINAL)


@pytest.mark.parametrize("n", [8, 48, 64, 100, 128])
def test_the_rotation_matrix_gives_rotate_halfs_values(n):
    x = torch.randn(2, 4, 7, n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    assert torch.equal(x @ rotation(n, torch.bfloat16, x.device), _standard(x))
    swapped = by_matmul(_standard)
    assert torch.equal(swapped(x), _standard(x))


def test_lane_aligned_halves_and_other_dtypes_keep_the_models_own_path():
    calls = []

    def original(x):
        calls.append(x.shape[-1])
        return _standard(x)

    swapped = by_matmul(original)
    swapped(torch.randn(1, 256).to(torch.bfloat16))  # half of 256 is 128 lanes: no shuffle to save
    swapped(torch.randn(1, 100))  # fp32: a TPU's default matmul precision would round it
    swapped(torch.randn(1, 100).to(torch.bfloat16))
    assert calls == [256, 100]


@pytest.mark.parametrize("name", ALL)
def test_every_family_computes_the_same_logits_with_the_matmul_rotation(stand_ins, name, restore_rotations):
    base = AutoModelForCausalLM.from_pretrained(stand_ins[name], dtype=torch.bfloat16)
    targets = lora_targets(base, ["o_proj"])  # the text decoder's (Gemma 4's vision tower has o_proj too)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets)).eval()
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        swapped = use_matmul_rotation(model)
        # every family rotates halves with rotate_half, but gpt-oss, which slices them in its own function
        assert (type(base).__module__ in swapped) == (name != "gpt_oss")
        assert torch.equal(model(input_ids=ids).logits, reference)
    assert use_matmul_rotation(model) == swapped  # idempotent


@pytest.mark.parametrize("family", ["glm", "cohere", "nanochat"])
def test_a_family_that_rotates_otherwise_keeps_its_own(family, restore_rotations):
    """GLM and Cohere rotate interleaved pairs, NanoChat halves with the other sign: not swapped."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    own = modeling.rotate_half

    class Layer(torch.nn.Module):
        pass

    Layer.__module__ = modeling.__name__
    assert use_matmul_rotation(torch.nn.Sequential(Layer())) == []
    assert modeling.rotate_half is own


def test_a_partial_rotary_slice_rotates_the_same(restore_rotations):
    """Phi-4-mini's layout: only the first 3/4 of each head rotates (``partial_rotary_factor``)."""
    from families import family_config
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{**family_config("phi3"), "partial_rotary_factor": 0.75})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        assert use_matmul_rotation(model)
        assert torch.equal(model(input_ids=ids).logits, reference)
