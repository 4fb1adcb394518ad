"""Training: TRL's SFTTrainer on XLA SPMD (``trainer``), its checkpoints, the guard, metrics, progress.

Uses ``xla``, ``model`` and ``data``; builds nothing itself (``sft`` composes the run).
"""
