"""Pallas kernels lowered for a TPU from a CPU host: the trace of ``memory --compile`` (never run).

torch_xla 2.9 traces a Pallas kernel in ``experimental/custom_kernel.py``'s ``trace_pallas`` with
``jax.jit(kernel, ...).lower(*args, **kwargs).compiler_ir()``, for jax's default backend; on a CPU
host that is the CPU, which refuses ("Only interpret mode is supported on CPU backend").
``jax.jit(...).trace(...).lower(lowering_platforms=("tpu",))`` lowers the same kernel for a TPU.
jax 0.7.1 also picks the Mosaic serialization version from the default backend
(``jax._src.tpu_custom_call.get_ir_version``: the newest, 8, when that backend is no TPU), which
libtpu 0.0.21 refuses ("expected <= 7 but got 8"); forward-compatible lowering for the TPU
(``xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS``) gives version 7.

Only a process that traces and never executes may call :func:`lower_pallas_for_tpu`: the kernels
it lowers are TPU code, which the CPU backend cannot run.
"""

from __future__ import annotations

from typing import Any

_installed = False


class _LowerForTpu:
    """``jax.jit(f)`` whose ``lower`` lowers for the TPU; everything else as jax's own."""

    def __init__(self, jitted: Any):
        self._jitted = jitted

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.trace(*args, **kwargs).lower(lowering_platforms=("tpu",))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def lower_pallas_for_tpu() -> None:
    """Make torch_xla's Pallas kernels (flash attention) lower for libtpu 0.0.21's TPU (idempotent)."""
    global _installed
    if _installed:
        return
    import jax
    from jax._src import xla_bridge

    xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.add("tpu")
    jit = jax.jit
    jax.jit = lambda *args, **kwargs: _LowerForTpu(jit(*args, **kwargs))
    _installed = True
