"""Step 1 is the steady step: the optimizer state torch would make, a first rate that is not 0 (the one compile,
checked on real runs: e2e/test_steady_runs.py)."""

from __future__ import annotations

import io

import pytest
import torch

from lowmem_tpu.train import steady


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.1 * (i + 1))
    optimizer.step()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_state_made_beforehand_gives_torchs_own_first_steps_bit_for_bit(amsgrad):
    fresh, made = _params(), _params()
    reference = torch.optim.AdamW(fresh, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    prefilled = torch.optim.AdamW(made, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    assert steady.make_adam_state(prefilled, torch.zeros_like) == 2
    assert steady.make_adam_state(prefilled, torch.zeros_like) == 0  # state there already: untouched
    for _ in range(3):
        _step(reference, fresh)
        _step(prefilled, made)
    for a, b in zip(fresh, made, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh, made, strict=True):
        left, right = reference.state[a], prefilled.state[b]
        assert left.keys() == right.keys()
        for key in left:
            assert left[key].device == right[key].device and left[key].dtype == right[key].dtype, key
            assert torch.equal(left[key], right[key]), key


def test_other_optimizers_make_their_own_state():
    from transformers.optimization import Adafactor

    optimizer = Adafactor(_params(), lr=1e-3, scale_parameter=False, relative_step=False)
    assert steady.make_adam_state(optimizer, torch.zeros_like) == 0
    assert not optimizer.state


@pytest.mark.parametrize("name", ["linear", "cosine", "constant_with_warmup"])
def test_a_warm_up_starts_at_its_second_steps_rate_and_the_schedule_still_saves(name):
    from transformers import get_scheduler

    def rates(shift: bool) -> tuple[list[float], dict]:
        optimizer = torch.optim.AdamW(_params(), lr=1e-3)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=4, num_training_steps=10)
        if shift:
            steady.no_zero_first_rate(scheduler)
        out = []
        for _ in range(10):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out, scheduler.state_dict()

    plain, _ = rates(False)
    shifted, state = rates(True)
    assert plain[0] == 0 and shifted[0] == plain[1] > 0
    assert shifted[1:] == plain[1:]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # what a resume reads (train.trainer)


def test_a_schedule_without_warm_up_is_unchanged():
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(_params(), lr=1e-3)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=10)
    steady.no_zero_first_rate(scheduler)
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_a_capturable_group_is_left_to_torch_and_the_others_are_made():
    first, second = _params()
    optimizer = torch.optim.AdamW([{"params": [first], "capturable": True}, {"params": [second]}], lr=1e-3)
    assert steady.make_adam_state(optimizer, torch.zeros_like) == 1
    assert not optimizer.state[first] and set(optimizer.state[second]) == {"step", "exp_avg", "exp_avg_sq"}
