"""lowmem-tpu: fine-tune LLMs on TPUs without running out of memory, LoRA or full FSDP from one YAML recipe.

The flow of a run, one folder per part, data moving one way: ``config`` (the recipe as data) ->
``preflight`` (what this machine must have) -> ``xla`` (torch_xla: runtime, mesh, sharding) -> ``model`` and
``data`` (the base, the tokenizer, static rows) -> ``train`` (TRL's trainers on XLA) -> ``publish`` (export,
merge, push, GGUF); ``sft`` composes them, ``infer`` uses what a run wrote, ``memory`` plans by arithmetic,
``measure`` compiles the real step (XLA:CPU, libtpu) and tunes it, ``doctor`` checks a machine, ``cli`` is the
command line. Basic modules, importing nothing heavy: ``errors``, ``console``, ``files``, ``hosts`` (which
host of a pod slice this is), ``machine`` (TPU or CPU here, RAM) and ``faults`` (the fault matrix's kill points).
"""

__version__ = "0.1.0"
