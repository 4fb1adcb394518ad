"""FSDPv2 (SPMD) sharding: parameter placement, per-layer wrapping and checkpointing.

Parameters are moved to the devices one at a time and sharded on arrival, so a device
never holds a replicated copy of the whole model. Each decoder layer is then wrapped
in ``SpmdFullyShardedDataParallel`` (optionally around torch_xla's ``checkpoint_module``)
and the whole model in one more wrapper that shards the output along the batch.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lowmem_tpu.config import ShardingSection
from lowmem_tpu.model import layer_class
from lowmem_tpu.model.rope import use_matmul_rotation
from lowmem_tpu.xla.runtime import Runtime


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


def place_like(host: torch.Tensor, param: torch.Tensor, runtime: Runtime, strategy: str) -> torch.Tensor:
    """A host tensor moved to the devices and sharded like ``param`` (as ``place_parameters`` places weights)."""
    import torch_xla.distributed.spmd as xs

    moved = host.to(runtime.device)
    xs.mark_sharding(moved, runtime.mesh, partition_spec(param.shape, strategy))
    return moved


def shard_like(tensor: torch.Tensor, param: torch.Tensor, runtime: Runtime, strategy: str) -> None:
    """Give a device tensor shaped like ``param`` (e.g. its optimizer state) the same sharding."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, runtime.mesh, partition_spec(param.shape, strategy))


def zeros_placed(param: torch.Tensor, runtime: Runtime, strategy: str) -> torch.Tensor:
    """Zeros shaped like ``param``, made on the devices (no host copy) and sharded like it."""
    zeros = torch.zeros(param.shape, dtype=param.dtype, device=runtime.device)
    shard_like(zeros, param, runtime, strategy)
    return zeros


def replicate(tensor: torch.Tensor, mesh: Any) -> None:
    """Annotate a device tensor as replicated on every device (a step's scalar sums carry it from step 2 on)."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, mesh, (None,) * tensor.dim())


def shard_output(output: Any, mesh: Any) -> None:
    """Shard the model output along the batch; TRL's fused LM head returns ``logits=None`` (trap ``logits-none``).

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


def wrap_model(model: nn.Module, cfg: ShardingSection, runtime: Runtime) -> nn.Module:
    """Wrap every decoder layer (checkpointed if asked) and the whole model in FSDPv2.

    With ``scan_layers`` the layers are scanned instead (their weights stay sharded as placed,
    gathered one layer at a time inside the scan) and only the whole model is wrapped.
    """
    import functools

    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    from lowmem_tpu.xla.shared_kv import checkpoint_sharing_kv

    gather_quantized(model, runtime.mesh)
    use_matmul_rotation(model)  # rotary embeddings without lane shuffles (model.rope)
    layer = layer_class(model, cfg.layer_class)
    every = cfg.checkpoint_every
    if cfg.scan_layers:
        from lowmem_tpu.xla.scan import scan_decoder

        scan_decoder(model, layer, every == 1)
        return FSDPv2(model, mesh=runtime.mesh, shard_output=shard_output)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    wrapped = itertools.count()  # the auto-wrap policy reaches the decoder layers in order

    def wrap_layer(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if every and next(wrapped) % every == 0:
            module = checkpoint_sharing_kv(module, checkpoint_module)  # Gemma 4's shared K/V as tensors
        return FSDPv2(module, *args, **kwargs)

    if every and hasattr(model, "enable_input_require_grads"):
        # Trap ``gradient-checkpointing``: torch_xla skips checkpointing a layer whose inputs need no grad:
        # with a frozen embedding (LoRA) that would be the first layer. Make the embedding output need grad.
        model.enable_input_require_grads()
    return FSDPv2(
        model,
        mesh=runtime.mesh,
        shard_output=shard_output,
        auto_wrap_policy=policy,
        auto_wrapper_callable=wrap_layer,
    )


def gather_quantized(model: nn.Module, mesh: Any) -> int:
    """Give each quantized layer the annotation that makes a tensor whole (``QuantizedLinear.gather``).

    An int8/int4 layer asks for its packed weight and scales whole, so the all-gather moves the packed bytes
    (left to itself the SPMD partitioner dequantizes each chip's shard and gathers the bf16 result). An NF4
    layer asks for its block maxima whole and its dequantized weight whole: each chip unpacks its own shard of
    the indices, a fraction of the work of unpacking them all (``model.quantize``).
    ``annotate_custom_sharding`` (torch_xla 2.9, ``distributed/spmd/xla_sharding.py``) annotates an IR value
    without touching placed data; the layer hands it a fresh value (its tensor plus the input's zero), never
    the parameter itself, which keeps its sharding. On one device there is nothing to gather. Returns how many
    layers it annotates.
    """
    import torch_xla.distributed.spmd as xs

    from lowmem_tpu.model.quantize import QuantizedLinear

    if math.prod(mesh.mesh_shape) == 1:
        return 0

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return xs.annotate_custom_sharding(tensor, mesh, (None,) * tensor.dim()).global_tensor

    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.gather = whole
    return len(layers)


def placeholder(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Device data of this shape and dtype with no buffer behind it: it can be traced, never run.

    torch_xla 2.9's ``core/xla_builder.create_placeholder_tensor`` (what its ``scan`` traces layer
    bodies with). ``mark_sharding`` refuses it ("Data does not present on any device"), so a program
    traced with placeholders has their arguments unannotated: ``measure.libtpu`` gives each the
    sharding ``place_parameters`` would (``partition_spec`` of its shape).
    """
    import torch_xla.core.xla_builder as xb

    return xb.create_placeholder_tensor(tuple(shape), dtype)


def place_placeholders(model: nn.Module) -> int:
    """Every parameter of ``model`` (meta or host) replaced by a placeholder of its shape and dtype.

    Buffers (rotary tables) are not touched: place them as usual. Tied weights stay tied. Returns
    the number of placeholders made.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(placeholder(param.shape, param.dtype), requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
    return len(made)


def fresh_placeholders(model: nn.Module) -> None:
    """Each parameter's data replaced by a new placeholder, the parameters kept: a placeholder once read
    (TRL's DPOTrainer copies the adapters into its reference adapter) carries a graph node that wrapping
    would try to run."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = placeholder(param.shape, param.dtype)


@contextlib.contextmanager
def placeholders_unmarked() -> Iterator[None]:
    """While tracing with placeholders: FSDPv2 marks every parameter it finds unsharded, and a
    placeholder cannot be marked. Its marking is skipped (``measure.libtpu`` gives the argument
    the same sharding, FSDPv2's largest-dimension rule); every other ``mark_sharding`` is unchanged."""
    import torch_xla.distributed.spmd as xs

    original = xs.mark_sharding

    def mark(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(tensor, *args, **kwargs)
        except RuntimeError as err:
            if "Data does not present" not in str(err):
                raise
            return None

    xs.mark_sharding = mark
    try:
        yield
    finally:
        xs.mark_sharding = original
