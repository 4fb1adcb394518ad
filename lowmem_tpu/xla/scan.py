"""``sharding.scan_layers``: one compiled decoder layer scanned over every layer's weights."""

from __future__ import annotations

import operator

import torch
from torch import nn

from lowmem_tpu.errors import UserError
from lowmem_tpu.xla.extras import require_scan_extra


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

        partition = {"partition_fn": recompute_all_partition} if self.checkpoint else {}
        params = [dict(layer.named_parameters()) for layer in self.layers]
        buffers = [dict(layer.named_buffers()) for layer in self.layers]
        stacked = tuple({k: self._stack([d[k] for d in ds]) for k in ds[0]} for ds in (params, buffers))
        mask = () if attention_mask is None else (attention_mask,)
        carry, _ = scan(self._one_layer, (hidden_states, *position_embeddings, *mask), stacked, **partition)
        return carry[0]


def _is_random(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def recompute_all_partition(joint_module: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Split the scanned layer's joint graph so that backward recomputes everything from the layer's
    inputs, as ``torch.utils.checkpoint`` does.

    torch_xla 2.9's ``scan`` (``torch_xla/experimental/scan.py``, ``partition_fn``) saves whatever the
    forward graph hands to the backward one as ys stacked over the layers. functorch's min-cut
    partition alone never recomputes a matmul, so it saves their outputs: for every layer the fp32
    attention probabilities and the MLP intermediates, 34 GiB per v5e-8 chip for the 3B LoRA step
    (docs/tpu_compiler.md). Marking each op ``MUST_RECOMPUTE`` (the tag ``torch.utils.checkpoint``'s
    selective policies set) leaves only the inputs to save. Random ops (and the items of their tuples)
    keep the partitioner's choice, which saves them: a recomputed dropout mask would differ.
    """
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch import config
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint_module.graph.nodes:
        drawn = _is_random(node) or (node.target is operator.getitem and _is_random(node.args[0]))
        if node.op == "call_function" and "recompute" not in node.meta and not drawn:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0  # one checkpointed region: the layer
    bans = ("used_far_apart", "long_fusible_chains", "materialized_backward", "not_in_allowlist", "reductions")
    with config.patch({f"ban_recompute_{ban}": False for ban in bans} | {"recompute_views": True}):
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def scan_decoder(model: nn.Module, layer: type[nn.Module], checkpoint: bool) -> None:
    """Replace the model's list of ``layer`` modules by one :class:`ScannedLayers`."""
    require_scan_extra()
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and layers and all(isinstance(m, layer) for m in layers):
            module.layers = nn.ModuleList([ScannedLayers(layers, checkpoint)])
            return
    raise UserError(f"sharding.scan_layers: no list of {layer.__name__} found to scan over")
