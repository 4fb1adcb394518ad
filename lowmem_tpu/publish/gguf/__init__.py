"""GGUF export for llama.cpp, Ollama and LM Studio: ``export`` (the command: a run, adapter or model in,
checked files out), ``writer`` (tensors renamed and converted as llama.cpp computes), ``metadata`` (an
architecture's hyper-parameters as llama.cpp reads them; ``gemma4`` and ``gpt_oss`` for the two whose layers
or experts llama.cpp lays out its own way), ``vocab`` (the tokenizer in one of llama.cpp's two
kinds), ``check`` (each file read back by transformers and llama.cpp) and ``llama_cpp`` (llama.cpp itself,
through llama-cpp-python, where installed)."""
