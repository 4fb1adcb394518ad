"""lowmem-tpu: fine-tune LLMs on one TPU VM without running out of memory."""

__version__ = "0.1.0"
