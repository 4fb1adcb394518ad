"""Activation checkpointing of decoder layers that share K/V across layers (Gemma 4's ``num_kv_shared_layers``).

A Gemma 4 layer marked ``store`` writes its keys and values into a dict that the model passes to every layer
(``shared_kv_states``); each later ``reuse`` layer reads them there instead of projecting its own. Under
torch_xla's reentrant checkpoint (``checkpoint_module``: the forward runs without autograd, again in the
backward) tensors that cross a layer through that dict carry no graph: the gradient the reusing layers send
back never reaches the producing layer's ``k_proj`` and ``v_proj``, and nothing fails. Here such a layer's
shared K/V cross the checkpoint as its own tensor inputs (a reusing layer) or outputs (a producing layer),
so autograd sees them as every other activation; the dict the model passes stays as transformers fills it.

Written against torch_xla 2.9's ``distributed/fsdp/utils.py::checkpoint_module``: it replaces the module's
``forward`` with one that packs keyword arguments into positional ones for ``torch_xla.utils.checkpoint``
(tensors among them become the checkpoint's inputs), and FSDPv2 wraps only a module whose ``forward`` is a
bound method.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn


def kv_sharing(layer: nn.Module) -> tuple[str, str] | None:
    """``("store" | "reuse", layer type)`` for a decoder layer that shares K/V with others, else None."""
    attention = getattr(layer, "self_attn", None)
    if getattr(attention, "is_kv_shared_layer", False):
        return "reuse", attention.layer_type
    if getattr(attention, "store_full_length_kv", False):
        return "store", attention.layer_type
    return None


def checkpoint_sharing_kv(layer: nn.Module, checkpoint: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``checkpoint(layer)`` with the layer's shared K/V passed through the checkpoint as tensors."""
    sharing = kv_sharing(layer)
    if sharing is None:
        return checkpoint(layer)
    mode, kind = sharing
    original = layer.forward

    def inner(_: nn.Module, *args: Any, shared_k: torch.Tensor | None = None, shared_v: torch.Tensor | None = None,
              **kwargs: Any):  # fmt: skip
        local = {kind: (shared_k, shared_v)} if mode == "reuse" else {}
        out = original(*args, shared_kv_states=local, **kwargs)
        return (out, *local[kind]) if mode == "store" else out

    layer.forward = MethodType(inner, layer)  # FSDP wraps a module whose forward is a method
    checkpoint(layer)  # replaces layer.forward with the checkpointed ``inner``
    checkpointed = layer.forward

    def outer(_: nn.Module, *args: Any, shared_kv_states: dict | None = None, **kwargs: Any):
        if mode == "reuse":
            kwargs["shared_k"], kwargs["shared_v"] = shared_kv_states[kind]
        out = checkpointed(*args, **kwargs)
        if mode == "store":
            out, key, value = out
            shared_kv_states[kind] = key, value
        return out

    layer.forward = MethodType(outer, layer)
    return layer
