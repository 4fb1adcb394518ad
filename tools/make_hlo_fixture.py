"""The real libtpu program the collectives' and cost model's unit tests read: the tiny recipe with flash attention,
one decoder layer, bf16, 16 rows of 128 tokens, compiled for Kaggle's v5e-8 by libtpu's compile-only client.

    .venv/bin/python tools/make_hlo_fixture.py   # writes tests/helpers/libtpu/tiny_flash_v5e8.hlo.gz

The optimized program (``after_codegen``) holds the Pallas kernels of flash attention's forward and backward,
all-gathers split into phases (one channel, many fused copies) and the adapters' all-reduce: what
tests/unit/test_collectives.py checks the parsers against. Compiled again when libtpu or the step changes.
"""

from __future__ import annotations

import gzip
import sys
import tempfile
from pathlib import Path

from lowmem_tpu.config import load_recipe
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.measure.tpu_compile import compile_recipe
from lowmem_tpu.measure.tpu_layers import cut

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "helpers" / "libtpu" / "tiny_flash_v5e8.hlo.gz"
OVERRIDES = [
    "runtime.device=tpu",
    "model.attn_implementation=flash",
    "data.max_length=128",
    "model.dtype=bfloat16",
    "train.global_batch_size=16",
]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="lowmem-fixture-") as tmp:
        recipe = cut(load_recipe(str(ROOT / "recipes" / "tiny_lora_cpu.yaml"), OVERRIDES), 1, Path(tmp))
        compile_recipe(recipe, DEVICES["v5e-8"], keep=Path(tmp) / "keep")
        text = (Path(tmp) / "keep" / "tpu.hlo.txt").read_bytes()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(gzip.compress(text, mtime=0))
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text):,} bytes of HLO text)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
