"""Using what a run trained: ``load`` (an adapter on its base, or a merged or full model, as the run
built it), ``decode`` (static-shape decoding with a KV cache: a bounded number of XLA graphs),
``session`` (prompts formatted as in training, for ``generate`` and ``chat``) and ``score``
(``eval``: held-out loss, perplexity, token accuracy and exact match, by the trainer and the
evaluator ``sft`` itself uses).

Imports ``config``, ``model``, ``data``, ``xla``, ``train`` and ``publish``; nothing imports it but ``cli``.
"""
