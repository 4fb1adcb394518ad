"""Training: TRL's trainers on XLA SPMD (``trainer`` for SFT, ``dpo``; ``args`` builds their configs), the
first step made the steady one (``steady``), fp32 ``master`` weights, ``checkpoint`` (the on-disk format),
the ``guard`` (signals, wall time, NaN), ``metrics``, ``progress``, ``report`` and ``plot``.

Uses ``xla``, ``model`` and ``data``; builds nothing itself (``sft`` composes the run).
"""
