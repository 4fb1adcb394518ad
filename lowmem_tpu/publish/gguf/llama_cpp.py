"""llama.cpp itself reading a GGUF file (``llama-cpp-python``, the ``gguf`` extra): its tokenizer's ids and its
logits on the check prompts, computed on the CPU. Absent the package, ``export`` says the check was not run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or its compiled library does not load
        return False
    return True


def load(path: Path, context: int) -> Any:
    """The model in ``path`` with logits kept for every position; quiet unless it fails to load."""
    from llama_cpp import Llama

    from lowmem_tpu.errors import UserError

    try:
        threads = os.cpu_count()
        with _plain_cpu_buffers():
            return Llama(
                model_path=str(path),
                logits_all=True,
                n_ctx=max(context, 16),
                verbose=False,
                n_threads=threads,
                type_k=0,
                type_v=0,  # GGML_TYPE_F32: a float32 KV cache
            )
    except ValueError as err:
        raise UserError(
            f"llama.cpp does not load {path.name} ({err}); nothing was written. A llama-cpp-python older than the "
            "pinned one may not know the architecture: pip install -c constraints.txt -e '.[gguf]'"
        ) from None


@contextmanager
def _plain_cpu_buffers() -> Iterator[None]:
    """Load with llama.cpp's plain CPU weight buffers (``use_extra_bufts = False``), not its repacked or AMX ones.

    On a CPU with AMX, llama.cpp 0.3.36 repacks the weights for its AMX kernels, and evaluating a small model's
    repacked weights crashes the process (a segmentation fault in ``llama_decode``). The check wants llama.cpp's
    reading of the file, not its fastest kernels. ``Llama`` builds its model parameters from
    ``llama_model_default_params()`` and exposes no ``use_extra_bufts``, so the default is replaced while the
    model loads."""
    import llama_cpp.llama as module

    default = module.llama_cpp.llama_model_default_params

    def plain() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_cpp.llama_model_default_params = plain
    try:
        yield
    finally:
        module.llama_cpp.llama_model_default_params = default


def tokenize(model: Any, text: str, add_bos: bool) -> list[int]:
    return model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def logits(model: Any, rows: list[Any]) -> list[Any]:
    """llama.cpp's float32 logits of each row of token ids, as a [1, length, vocab] tensor like transformers'."""
    import numpy as np
    import torch

    out = []
    for row in rows:
        ids = row[0].tolist()
        model.reset()
        model.eval(ids)
        out.append(torch.from_numpy(np.array(model.scores[: len(ids)], dtype=np.float32)).unsqueeze(0))
    return out
