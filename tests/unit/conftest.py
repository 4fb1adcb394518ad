"""The unit lane (``make check``): tests that never start XLA in their process and spawn no training or compile.

A test that starts the XLA runtime while it runs fails here: it belongs in tests/e2e. (Under ``make test``
an e2e module may have started XLA earlier in the same worker; a unit test after it is not blamed for that.)

A unit test also runs no backward pass: a CPU backward before XLA starts breaks every later XLA backward in
that process (PyTorch's autograd engine sizes its device queues once), and ``make test`` runs unit and e2e
modules in the same workers. Tests that need one call ``setup_runtime`` first and live in tests/e2e.
"""

from __future__ import annotations

import sys

import pytest


def xla_runtime_started() -> bool:
    if "torch_xla" not in sys.modules:
        return False
    torch_xla = sys.modules["torch_xla"]
    return torch_xla._XLAC._xla_runtime_is_initialized()


@pytest.fixture(autouse=True)
def no_xla_runtime():
    """Fail the test if the XLA runtime was started in this process while it ran."""
    before = xla_runtime_started()
    yield
    if not before and xla_runtime_started():
        pytest.fail("this test started the XLA runtime in the test process: move it to tests/e2e", pytrace=False)
