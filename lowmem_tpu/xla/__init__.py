"""The PyTorch/XLA backend: the only folder that imports torch_xla.

``runtime`` starts it (PJRT environment, SPMD, the mesh, the compile cache, compile counters),
``device`` answers questions about the devices (kind, memory, a tensor's sharding), ``devices``
is the catalog of TPU VMs as plain data, ``sharding`` places and wraps the model (FSDPv2 with
per-layer checkpointing) and ``scan`` scans one compiled layer over all of them.

Everything else asks this folder, so that a second backend (TorchTPU: FSDP2 on a ``"tpu"``
device) can sit beside it. It imports ``config`` and ``model``; torch_xla itself is imported
inside the functions that need it, so importing this package starts nothing.
"""
