"""Memory planning: what a recipe needs per device, and how that compares with what XLA measures.

``shape`` (the architecture and the recipe's memory-relevant settings), ``plan`` (the arithmetic),
``advise`` (the twin, what to turn on next, output), ``compiler`` (reading XLA's buffer
assignments), ``measure`` (compiling or running the real step in a subprocess), ``compare``
(LoRA vs full, planned beside measured). ``shape``, ``plan`` and ``advise`` import no torch.
"""
