"""Training: TRL's trainers on XLA SPMD (``trainer`` for SFT, ``preference`` for DPO, ORPO, CPO and SimPO with
their losses in ``pair_loss``; ``methods`` maps a method to its TRL config and trainer, ``args`` builds the
configs), the first step made the steady one (``steady``), fp32 ``master`` weights, ``checkpoint`` (the on-disk
format), the ``guard`` (signals, wall time, NaN), ``metrics``, ``progress``, ``report`` and ``plot``.

Uses ``xla``, ``model`` and ``data``; builds nothing itself (``run`` composes the run).
"""
