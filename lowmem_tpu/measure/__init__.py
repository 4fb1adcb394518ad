"""Measured memory: the recipe's real training step, traced and compiled in subprocesses, never trained.

The planner (:mod:`lowmem_tpu.memory`) is arithmetic; this folder asks XLA for the real figures.
``local`` starts ``child`` (a fresh Python, torch_xla's device settings read once) to compile the step
on the devices here and read one device's buffers (XLA:CPU's, or the TPU compiler's on a TPU), or to run
N real steps on a TPU (``compare``). ``tpu_compile`` traces the steady step on CPU devices with
placeholder weights (``trace``) and hands the program to ``libtpu``, libtpu's compile-only client in its
own subprocess: the only module here that imports jax. ``tpu_layers`` compiles a step too large for this
machine at 2 and 4 layers and extrapolates; ``tpu_report`` puts the compiler's figures beside the plan;
``buffers`` reads XLA's buffer assignments and out-of-memory messages; ``compare`` measures LoRA beside
full fine-tuning; ``hlo_text`` reads the TPU compiler's optimized program, ``hlo_cost`` sums its cycle
estimates, flops and HBM bytes and ``collectives`` what the interconnect carries into the step's time;
``tune`` searches the fastest settings that fit. It composes ``config``, ``model``, ``data``, ``xla``,
``train`` and ``memory``; importing the package itself starts nothing.
"""
