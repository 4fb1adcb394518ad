"""Memory planning: what a recipe needs per device, by arithmetic on the model's config and the recipe.

``shape`` (the architecture and the recipe's memory-relevant settings), ``plan`` (the arithmetic, in
the CPU backend's layout, ``cpu_layout``, or the TPU compiler's, ``tpu_layout`` with ``tiles``),
``advise`` (the twin, what to turn on next, output), ``record`` (what a run writes about its memory).
It imports ``config`` and nothing heavy at any depth: no torch, torch_xla, jax or transformers (the
caller reads the model's config: ``model.build.require_config``). What XLA measures of the real step
is :mod:`lowmem_tpu.measure`'s.
"""
