"""Every test runs on torch_xla's CPU backend with 4 virtual devices (one process, SPMD)."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The persistent compilation cache ("auto") goes under the user's cache directory: keep tests out of it.
if "LOWMEM_TPU_TEST_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LOWMEM_TPU_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="lowmem-tpu-cache-")
    atexit.register(shutil.rmtree, os.environ["LOWMEM_TPU_TEST_CACHE"], ignore_errors=True)
