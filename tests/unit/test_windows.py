"""A sliding window matters only to rows longer than it, checked against transformers' own eager attention.

A window of W keys hides a key from a query W or more positions later, so on rows of at most W tokens a
windowed model computes what it computes without its window. There ``flash`` (no window in the kernel) and
packed rows under eager attention (one mask in place of the model's window) compute the model; on longer rows
``validate`` refuses both and names ``chunked``. The stand-ins' windows are 7-8 keys (tests/helpers/families.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.features import attention_of
from lowmem_tpu.data.rows import _pack, _pad
from lowmem_tpu.errors import UserError
from lowmem_tpu.model.architecture import check_model
from lowmem_tpu.model.attention import packed_inputs

WINDOWED = ["mistral", "phi3", "gemma2", "gemma3"]


def _eager(path, **overrides):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **overrides).eval()


def _window(path) -> int:
    return attention_of(AutoConfig.from_pretrained(path)).window


@pytest.mark.parametrize("name", WINDOWED)
def test_rows_no_longer_than_the_window_never_meet_it(stand_ins, name):
    window = _window(stand_ins[name])
    windowed, unbounded = _eager(stand_ins[name]), _eager(stand_ins[name], sliding_window=4096)
    ids = torch.randint(0, 300, (2, window + 3), generator=torch.Generator().manual_seed(0))
    for length in (window, window + 1, window + 3):
        with torch.no_grad():
            same = torch.allclose(windowed(ids[:, :length]).logits, unbounded(ids[:, :length]).logits, atol=1e-5)
        attention = attention_of(windowed.config)
        assert same == (attention.packed_mask_refusal(length) is None), (length, attention)
        assert same == (not any("sliding" in f for f in attention.features(length))), length


def _losses(model, batch, segments=None) -> list[float]:
    """Summed next-token loss per sample: per row, or per segment of each packed row."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    terms = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    if segments is None:
        return [row.sum().item() for row in terms]
    owner = segments[:, 1:]
    return [terms[b][owner[b] == s].sum().item() for b in range(len(terms)) for s in owner[b].unique() if s != 0]


@pytest.mark.parametrize("name", WINDOWED)
def test_packed_eager_rows_as_long_as_the_window_give_each_samples_own_losses(stand_ins, name):
    window = _window(stand_ins[name])
    rng = np.random.default_rng(0)
    samples = [(ids, ids.copy()) for ids in (rng.integers(3, 300, n) for n in (window - 3, 3, window, 2, 4))]
    model = _eager(stand_ins[name])
    as_tensors = lambda arrays: {k: torch.as_tensor(v, dtype=torch.long) for k, v in arrays.items()}  # noqa: E731
    alone = _losses(model, as_tensors(_pad(samples, window, 0)))
    rows = as_tensors(_pack(samples, window, 0))
    assert len(rows["input_ids"]) < len(samples)
    packed = _losses(model, packed_inputs(rows, "eager", torch.float32), rows["segment_ids"])
    assert packed == pytest.approx(alone, rel=1e-5, abs=1e-5)


def _recipe(path, *overrides):
    return load_recipe(None, [f"model.name_or_path={path}", "runtime.device=tpu", "runtime.target=v5e-8", *overrides])


@pytest.mark.parametrize("name", ["mistral", "phi3", "gemma3"])
def test_flash_is_taken_where_the_rows_fit_the_window_and_refused_past_it(tmp_path, name):
    import json

    from families import family_config

    (tmp_path / "config.json").write_text(json.dumps(family_config(name) | {"sliding_window": 256}))
    check_model(_recipe(tmp_path, "model.attn_implementation=flash", "data.max_length=256"))
    longer = _recipe(tmp_path, "model.attn_implementation=flash", "data.max_length=512")
    with pytest.raises(UserError, match=r"no sliding windows of 256 keys \(rows of 512 tokens\).*chunked"):
        check_model(longer)


def test_gemma2s_soft_capped_scores_refuse_flash_at_any_length(tmp_path):
    import json

    from families import family_config

    (tmp_path / "config.json").write_text(json.dumps(family_config("gemma2") | {"sliding_window": 4096}))
    with pytest.raises(UserError, match=r"no attention scores soft-capped at 50, which gemma2 defines"):
        check_model(_recipe(tmp_path, "model.attn_implementation=flash", "data.max_length=128"))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_packing_with_a_mask_is_refused_where_the_rows_meet_the_window(stand_ins, implementation):
    path, window = stand_ins["mistral"], _window(stand_ins["mistral"])
    packed = ["data.packing=true", f"model.attn_implementation={implementation}"]
    check_model(_recipe(path, *packed, f"data.max_length={window}"))
    with pytest.raises(
        UserError, match=r"data.packing: .*sliding window of 8 keys.*use model.attn_implementation: chunked"
    ):
        check_model(_recipe(path, *packed, f"data.max_length={window + 1}"))
    check_model(
        _recipe(path, "data.packing=true", "model.attn_implementation=chunked", f"data.max_length={window + 1}")
    )


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_packed_eager_rows_longer_than_the_window_would_lose_it(stand_ins, name):
    """Why packing with a mask is refused there: the packed row's mask replaces the window, a long sample's
    losses change. ``chunked`` (segment ids and the window, block by block) keeps them: e2e/test_family_attention."""
    window, path = _window(stand_ins[name]), stand_ins[name]
    rng = np.random.default_rng(1)
    samples = [(ids, ids.copy()) for ids in (rng.integers(3, 300, n) for n in (2 * window, 3))]
    model = _eager(path)
    as_tensors = lambda arrays: {k: torch.as_tensor(v, dtype=torch.long) for k, v in arrays.items()}  # noqa: E731
    alone = _losses(model, as_tensors(_pad(samples, 2 * window + 3, 0)))
    rows = as_tensors(_pack(samples, 2 * window + 3, 0))
    packed = _losses(model, packed_inputs(rows, "eager", torch.float32), rows["segment_ids"])
    assert packed[0] != pytest.approx(alone[0], rel=1e-5, abs=1e-5)  # equal to 1e-5 when the window binds nothing
    assert attention_of(model.config).refusal("eager", True, 2 * window + 3)


def test_memory_and_tune_refuse_packed_eager_rows_that_meet_the_window(stand_ins):
    from lowmem_tpu.memory.advise import plan_recipe
    from lowmem_tpu.model.build import require_config

    recipe = _recipe(stand_ins["mistral"], "data.packing=true", "model.attn_implementation=eager", "data.max_length=64")
    with pytest.raises(UserError, match=r"data.packing: .*sliding window"):
        plan_recipe(recipe, "v5e-8", require_config(recipe))


def test_the_flash_kernel_refuses_a_window_its_rows_meet_or_a_soft_cap():
    from lowmem_tpu.xla.flash import flash_attention_forward

    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="no window"):
        flash_attention_forward(None, q, q, q, None, sliding_window=7)
    with pytest.raises(RuntimeError, match="no soft-cap"):
        flash_attention_forward(None, q, q, q, None, softcap=50.0)
