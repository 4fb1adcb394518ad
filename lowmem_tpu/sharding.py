"""FSDPv2 (SPMD) sharding: parameter placement, per-layer wrapping and checkpointing.

Parameters are moved to the devices one at a time and sharded on arrival, so a device
never holds a replicated copy of the whole model. Each decoder layer is then wrapped
in ``SpmdFullyShardedDataParallel`` (optionally around torch_xla's ``checkpoint_module``)
and the whole model in one more wrapper that shards the output along the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowmem_tpu.errors import UserError
from lowmem_tpu.recipe import ShardingSection
from lowmem_tpu.runtime import Runtime


def partition_spec(shape: torch.Size, strategy: str) -> tuple[str | None, ...]:
    """FSDP shards a tensor's largest dimension over the ``fsdp`` axis (the rule FSDPv2 uses)."""
    spec: list[str | None] = [None] * len(shape)
    if strategy == "fsdp" and spec:
        spec[max(range(len(shape)), key=lambda i: shape[i])] = "fsdp"
    return tuple(spec)


def place_parameters(model: nn.Module, runtime: Runtime, strategy: str) -> None:
    """Move every parameter and buffer to the XLA devices, sharding each as it arrives.

    Parameters are replaced by new ones on the device (tied weights stay tied), so
    references to the old host parameters must be taken after this call.
    """
    import torch_xla.distributed.spmd as xs

    placed: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in placed:
                moved = param.detach().to(runtime.device)
                xs.mark_sharding(moved, runtime.mesh, partition_spec(moved.shape, strategy))
                placed[id(param)] = nn.Parameter(moved, requires_grad=param.requires_grad)
            module._parameters[name] = placed[id(param)]
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buf.to(runtime.device)


def shard_like(tensor: torch.Tensor, param: torch.Tensor, runtime: Runtime, strategy: str) -> None:
    """Give a device tensor shaped like ``param`` (e.g. its optimizer state) the same sharding."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, runtime.mesh, partition_spec(param.shape, strategy))


def layer_class(model: nn.Module, name: str | None) -> type[nn.Module]:
    """The decoder layer class to wrap: ``name``, or the model's own ``_no_split_modules``."""
    names = [name] if name else list(getattr(_base(model), "_no_split_modules", None) or [])
    classes = {type(m).__name__: type(m) for m in model.modules()}
    for candidate in names:
        if candidate in classes:
            return classes[candidate]
    raise UserError(
        f"sharding.layer_class: {names[0] if names else 'no decoder layer class'} is not a module of this model; "
        f"its classes include {', '.join(sorted(c for c in classes if 'Layer' in c or 'Block' in c)) or 'none'}"
    )


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard_output(output: Any, mesh: Any) -> None:
    """Shard the model output along the batch; TRL's fused LM head returns ``logits=None``.

    The first batch-major tensor (logits, else per-token log-probs) is annotated; a
    scalar-only output (the loss) needs nothing.
    """
    import torch_xla.distributed.spmd as xs

    if isinstance(output, torch.Tensor):
        candidates = [output]
    elif isinstance(output, tuple):
        candidates = list(output)
    else:
        candidates = [getattr(output, "logits", None), *(output.values() if hasattr(output, "values") else [])]
    for tensor in candidates:
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            xs.mark_sharding(tensor, mesh, ("fsdp", *([None] * (tensor.dim() - 1))))
            return


class _Carry(nn.Module):
    """A decoder layer as a function of the scanned carry: (hidden, cos, sin[, mask])."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *mask: torch.Tensor):
        out = self.layer(hidden, attention_mask=mask[0] if mask else None, position_embeddings=(cos, sin))
        return (out, cos, sin, *mask)


class _StackLayers(torch.autograd.Function):
    """``torch.stack`` of one weight of every layer, whose backward picks each layer's gradient by a
    runtime index instead of a constant slice.

    A constant slice ``grad[i]`` fuses into whatever consumes it (the optimizer update and the
    gradient norm of that layer's tensor), so every such fused kernel differs by its offset and
    XLA:CPU compiles one per layer, tensor and op: about 1,500 kernels for 26 layers of LoRA. A
    dynamic slice by a device scalar makes those kernels identical across layers, and XLA compiles
    each once. The gradient values are the same.
    """

    @staticmethod
    def forward(ctx, indices, *tensors):
        ctx.indices = indices
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx, grad):
        return (None, *(grad.index_select(0, index).squeeze(0) for index in ctx.indices))


class ScannedLayers(nn.Module):
    """Replaces the decoder layer list: one compiled layer, scanned over every layer's weights.

    Like torch_xla's ``scan_layers``, but the weights are stacked by ``_StackLayers`` and the
    layer function is built once (the scan's trace cache is keyed on it).
    """

    def __init__(self, layers: nn.ModuleList, checkpoint: bool):
        super().__init__()
        self.layers = nn.ModuleList(_Carry(layer) for layer in layers)
        self.checkpoint = checkpoint
        self._indices: tuple[torch.Tensor, ...] = ()
        template = self.layers[0]

        def one_layer(carry, weights):
            return torch.func.functional_call(template, weights, carry, strict=True), None

        self._one_layer = one_layer

    def _stack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not any(t.requires_grad for t in tensors):
            return torch.stack(tensors)
        if len(self._indices) != len(tensors) or self._indices[0].device != tensors[0].device:
            # Device data, so the index is an input of the compiled graph and never a constant.
            self._indices = tuple(torch.tensor([i]).to(tensors[0].device) for i in range(len(tensors)))
        return _StackLayers.apply(self._indices, *tensors)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        from torch_xla.experimental.scan import scan  # under SPMD it calls into jax

        partition = {}
        if self.checkpoint:
            # Recompute inside the scanned layer in backward instead of saving its activations.
            from functorch.compile import min_cut_rematerialization_partition

            partition["partition_fn"] = min_cut_rematerialization_partition
        params = [dict(layer.named_parameters()) for layer in self.layers]
        buffers = [dict(layer.named_buffers()) for layer in self.layers]
        stacked = tuple({k: self._stack([d[k] for d in ds]) for k in ds[0]} for ds in (params, buffers))
        mask = () if attention_mask is None else (attention_mask,)
        carry, _ = scan(self._one_layer, (hidden_states, *position_embeddings, *mask), stacked, **partition)
        return carry[0]


def _require_scan_extra() -> None:
    # torch_xla 2.9's scan keeps carries sharded alike through jax (xb.call_jax needs jax and torchax).
    try:
        import jax  # noqa: F401
        import torchax  # noqa: F401
    except ImportError as err:
        raise UserError(
            f"sharding.scan_layers: needs jax and torchax ({err}); install them with: make install-scan"
        ) from None


def _scan_decoder(model: nn.Module, layer: type[nn.Module], checkpoint: bool) -> None:
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and layers and all(isinstance(m, layer) for m in layers):
            module.layers = nn.ModuleList([ScannedLayers(layers, checkpoint)])
            return
    raise UserError(f"sharding.scan_layers: no list of {layer.__name__} found to scan over")


def wrap_model(model: nn.Module, cfg: ShardingSection, runtime: Runtime) -> nn.Module:
    """Wrap every decoder layer (checkpointed if asked) and the whole model in FSDPv2.

    With ``scan_layers`` the layers are scanned instead (their weights stay sharded as placed,
    gathered one layer at a time inside the scan) and only the whole model is wrapped.
    """
    import functools

    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    layer = layer_class(model, cfg.layer_class)
    if cfg.scan_layers:
        _require_scan_extra()
        _scan_decoder(model, layer, cfg.activation_checkpointing)
        return FSDPv2(model, mesh=runtime.mesh, shard_output=shard_output)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})

    def wrap_layer(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if cfg.activation_checkpointing:
            module = checkpoint_module(module)
        return FSDPv2(module, *args, **kwargs)

    if cfg.activation_checkpointing and hasattr(model, "enable_input_require_grads"):
        # torch_xla skips checkpointing a layer whose inputs need no grad: with a frozen
        # embedding (LoRA) that would be the first layer. Make the embedding output need grad.
        model.enable_input_require_grads()
    return FSDPv2(
        model,
        mesh=runtime.mesh,
        shard_output=shard_output,
        auto_wrap_policy=policy,
        auto_wrapper_callable=wrap_layer,
    )
