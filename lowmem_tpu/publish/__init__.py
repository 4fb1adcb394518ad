"""After training: ``export`` (adapter or full model), ``adapter_base`` (the base an adapter goes onto, built
as the run built it), ``merge`` (+ ``verify``), ``card``, ``hub`` (push), ``vllm`` (vLLM's loader rules) and
``gguf`` (files for llama.cpp).

Imports ``config``, ``model`` and ``files``; never ``xla`` or ``train``: merging and checking run on
the host CPU.
"""
