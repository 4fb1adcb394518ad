"""Every test runs on torch_xla's CPU backend with 4 virtual devices (one process, SPMD).

Two lanes: ``tests/unit`` (never starts XLA in the test process, spawns no training or compile; ``make check``)
and ``tests/e2e`` (the rest); ``make test`` runs both. ``tests/helpers`` holds the modules tests import
(``from families import ...``): it is put on ``sys.path`` here. The module-scoped fixtures that a unit and an
e2e module of one topic share are defined here; a ``tpu``-marked test is skipped unless ``PJRT_DEVICE=TPU``.
"""

import os
import sys
from pathlib import Path

import pytest

from lowmem_tpu.xla.runtime import cpu_xla_flags

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# XLA:CPU's flags as a run on the CPU backend sets them, for the tests that start torch_xla themselves: every
# process of the suite compiles alike (no torch is imported here). Never on a TPU.
if os.environ["PJRT_DEVICE"].upper() == "CPU":
    os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))

# The persistent compilation cache ("auto") goes under the user's cache directory: keep tests out of it.
if "LOWMEM_TPU_TEST_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LOWMEM_TPU_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="lowmem-tpu-cache-")
    atexit.register(shutil.rmtree, os.environ["LOWMEM_TPU_TEST_CACHE"], ignore_errors=True)

HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

ON_TPU = os.environ.get("PJRT_DEVICE", "CPU").upper() == "TPU"


def pytest_collection_modifyitems(config, items):
    """The one TPU skip: ``@pytest.mark.tpu`` tests run only with ``PJRT_DEVICE=TPU``."""
    if ON_TPU:
        return
    skip = pytest.mark.skip(reason="needs a TPU (PJRT_DEVICE=TPU)")
    for item in items:
        if item.get_closest_marker("tpu"):
            item.add_marker(skip)


# ----------------------------------------------------------------------------- shared by a unit and an e2e module


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Each family's stand-in directory (``families.make_family``): test_families and test_family_attention."""
    from families import ALL_NAMES, make_family

    root = tmp_path_factory.mktemp("families")
    return {name: make_family(root / name, name) for name in ALL_NAMES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The Open-Llama-shaped directory (``open_llama_like.build``): the format and Open Llama modules."""
    from open_llama_like import build

    return build(tmp_path_factory.mktemp("open_llama_like"))


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory) -> Path:
    """``open_llama_data.ALPACA`` eight times over as a JSON array, as alpaca-cleaned ships."""
    from open_llama_data import write_alpaca

    return write_alpaca(tmp_path_factory.mktemp("alpaca") / "alpaca.json")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One tiny float base saved as safetensors, as pytorch_model.bin and sharded: the quantize modules."""
    import torch
    from tiny_models import make_base
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qbase")
    safetensors = make_base(root / "safetensors")
    model = AutoModelForCausalLM.from_pretrained(safetensors, dtype=torch.float32)
    model.save_pretrained(root / "bin", safe_serialization=False)
    model.save_pretrained(root / "sharded", max_shard_size="200KB")
    return {"safetensors": safetensors, "bin": root / "bin", "sharded": root / "sharded"}
