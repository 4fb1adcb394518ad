"""Training data: read records (``sources``, their columns by ``fields``), pick the training or held-out ones
(``splits``), format them (``formats``; ``chat`` and ``templates`` for conversations; ``pairs`` for
preference data, ``unpaired`` for KTO's labelled rows), cut them to static shapes (``rows``), keep them
(``cache``); ``fill`` (how full the rows are) and ``preview`` (``lowmem-tpu data``) read them back.

Imports ``config`` and ``errors`` only, never ``xla`` or ``model``: a tokenizer comes in as an argument.
``datasets``, ``numpy`` and ``torch`` are imported inside the functions that use them.
"""

from lowmem_tpu.data.formats import IGNORE_INDEX, alpaca_prompt, generation_prompt
from lowmem_tpu.data.rows import COLUMNS, build_dataset, collate, exact_match_prompts
from lowmem_tpu.data.sources import DataError, load_records
from lowmem_tpu.data.splits import select_records
from lowmem_tpu.data.templates import set_chat_template

__all__ = [
    "COLUMNS",
    "IGNORE_INDEX",
    "DataError",
    "alpaca_prompt",
    "build_dataset",
    "collate",
    "exact_match_prompts",
    "generation_prompt",
    "load_records",
    "select_records",
    "set_chat_template",
]
