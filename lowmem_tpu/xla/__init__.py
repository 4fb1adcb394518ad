"""The PyTorch/XLA backend: the only folder that imports torch_xla.

``runtime`` starts it (PJRT environment, SPMD, the mesh, the compile cache, compile counters), ``device``
answers questions about the devices (kind, memory, a tensor's sharding), ``tpu`` reads the TPU VM's hardware
without torch_xla (the chips on the PCI bus, libtpu's HBM metrics, which under SPMD torch_xla cannot give),
``sharding`` places and wraps the model (FSDPv2 with per-layer checkpointing; ``shared_kv`` checkpoints layers
that share K/V, Gemma 4's), ``scan`` scans one compiled layer over all of them (``extras`` checks the [scan]
extra it needs), ``flash`` is torch_xla's Pallas attention kernel and ``experts`` megablox's grouped matmuls
behind a MoE layer (``pallas`` lowers both for a TPU in a trace),
``transfer`` copies device tensors to the host and ``sharded_state`` writes and reads sharded state
(torch.distributed.checkpoint). The catalog of TPU VMs is plain data in ``config.devices``.

Everything else asks this folder, so that a second backend (TorchTPU: FSDP2 on a ``"tpu"``
device) can sit beside it. It imports ``config`` and ``model``; torch_xla itself is imported
inside the functions that need it, so importing this package starts nothing.
"""
