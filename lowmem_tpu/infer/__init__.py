"""Using what a run trained: ``load`` (an adapter on its base, or a merged or full model, as the run
built it), ``decode`` (static shapes: a KV cache for one prompt, a full buffer for a batch of them),
``session`` (prompts formatted as in training, for ``generate`` and ``chat``) and ``score``
(``eval``: held-out loss, perplexity, token accuracy and exact match, by the trainer and the
evaluator ``sft`` itself uses: greedy ``exact_match``), and ``harness`` (``eval --tasks``: lm-evaluation-harness).

Imports ``config``, ``model``, ``data``, ``xla``, ``train`` and ``publish``; ``cli`` and ``sft`` import it.
"""
