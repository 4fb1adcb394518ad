"""Skip conditions shared by several modules (a ``tpu``-marked test is skipped off a TPU by tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest

# libtpu's compile-only client and jax: `pip install -e ".[compiler]"` (the dev extra has them).
needs_compiler = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("jax", "libtpu")),
    reason="the [compiler] extra is not installed",
)
