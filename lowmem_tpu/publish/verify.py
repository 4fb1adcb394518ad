"""The equivalence check of a merge: logits of fixed prompts, in float32, against base + adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "reverse abcde",
    "Once upon a time, in a small village,",
)
# max |merged - (base + adapter)| over every logit, divided by max |base + adapter|, both computed in
# float32 (see float32_compute). In float32 the two differ only by summation order (measured ~1e-6). In
# bfloat16 the merged weight W + BA is rounded to 8 mantissa bits while the reference keeps BA apart:
# measured 3e-3 (test adapter) and 1.6e-2 (the demo's adapter, whose BA is large next to a random W);
# dropping the adapter altogether moves the logits by 0.5-1.2, far outside the tolerance.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def prompt_ids(tokenizer: Any) -> list[Any]:
    """Token ids of the fixed check prompts (each one row, no padding)."""
    rows = [tokenizer(text, return_tensors="pt")["input_ids"] for text in PROMPTS]
    return [row for row in rows if row.shape[1] > 0]


def logits(model: Any, rows: list[Any]) -> list[Any]:
    """Logits of each prompt row, computed in float32 whatever the weights' dtype."""
    import torch

    with torch.no_grad(), float32_compute(model):
        return [model(input_ids=row).logits.float() for row in rows]


@contextmanager
def float32_compute(model: Any) -> Iterator[None]:
    """Run ``model`` in float32 without a float32 copy of it.

    Each module's own parameters are upcast just before it runs, and their original tensors put
    back right after, so one module at a time is held in float32 and weights that ``from_pretrained``
    left memory-mapped stay so. Two bf16 models compared this way differ by their weights, not by
    bf16 arithmetic noise.
    """
    import torch

    originals: dict[Any, Any] = {}
    upcast: dict[Any, list[Any]] = {}

    def cast(value: Any) -> Any:
        return value.float() if torch.is_tensor(value) and value.is_floating_point() else value

    def own(module: Any) -> list[Any]:
        # PEFT's LoRA on a stack of experts (ParamWrapper) reads its adapters and the stack, a parametrized
        # weight, outside their modules' forward: the whole wrapper is upcast while it runs
        if type(module).__name__ == "ParamWrapper":
            return list(module.parameters())
        return list(module.parameters(recurse=False))

    def up(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # a quantized layer's packed integers stay as they are; a nested wrapper's are its outer one's
        mine = [p for p in own(module) if p.is_floating_point() and p not in originals]
        for p in mine:
            originals[p] = p.data
            p.data = p.data.float()
        upcast[module] = mine
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def down(module: Any, args: tuple, output: Any) -> None:
        for p in upcast.pop(module, []):
            p.data = originals.pop(p)

    owners = [m for m in model.modules() if own(m)]
    handles = [m.register_forward_pre_hook(up, with_kwargs=True) for m in owners]
    handles += [m.register_forward_hook(down) for m in owners]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def compare(reference: list[Any], merged: list[Any], dtype: str) -> dict[str, Any]:
    """The equivalence figure: max |merged - reference| / max |reference| over every logit, and top-1 agreement."""
    diff = max(float((m - r).abs().max()) for r, m in zip(reference, merged, strict=True))
    scale = max(float(r.abs().max()) for r in reference)
    same = sum(int((m.argmax(-1) == r.argmax(-1)).sum()) for r, m in zip(reference, merged, strict=True))
    tokens = sum(r.shape[1] for r in reference)
    relative = diff / max(scale, 1e-12)
    return {
        "metric": "max |merged - (base + adapter)| / max |base + adapter| over the logits of every prompt token, "
        "computed in float32",
        "prompts": list(PROMPTS),
        "tokens": tokens,
        "max_abs_diff": diff,
        "max_abs_logit": scale,
        "relative_diff": relative,
        "tolerance": TOLERANCE[dtype],
        "top1_agreement": same / tokens,
        "passed": relative <= TOLERANCE[dtype],
    }
