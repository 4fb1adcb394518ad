"""Peak host memory (RSS) of ``lowmem-tpu merge``, measured with ``/usr/bin/time -v``.

    .venv/bin/python benchmarks/measure_merge_memory.py                  # tiny, 0.5b, 1b
    .venv/bin/python benchmarks/measure_merge_memory.py --sizes tiny,1b --work /tmp/merge-mem

For each size it saves a random-init Llama base in bfloat16 and a LoRA adapter for it (r=16 on
every projection, random A and B, like a trained adapter), then runs the real CLI
``lowmem-tpu merge ADAPTER --out OUT --dtype bfloat16`` under ``/usr/bin/time -v`` and reads
"Maximum resident set size"; it also samples the process's anonymous RSS (RssAnon, memory that
is not a memory-mapped file) every 20 ms. A process that only imports what the merge imports gives
the fixed overhead. Results are printed as a Markdown table and written to WORK/results.json.
(``apt-get install -y time`` if /usr/bin/time is missing.)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
LLAMA = {"vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
SIZES = {
    "tiny": {},  # the shipped tiny-llama config: 4 layers, hidden 128
    "0.5b": {**LLAMA, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
             "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 128},
    "1b": {**LLAMA, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
           "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128},
}  # fmt: skip
IMPORTS = (
    "import torch, transformers, peft, lowmem_tpu.publish.merge; from peft import PeftModel; import lowmem_tpu.console"
)

BUILD = """
import json, sys, torch
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from lowmem_tpu.config.assets import ASSETS

base, adapter, overrides = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
tiny = ASSETS / "tiny-llama"
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny, **overrides), dtype=torch.bfloat16)
model.save_pretrained(base)
AutoTokenizer.from_pretrained(tiny).save_pretrained(base)
del model
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
peft_model = get_peft_model(model, lora)
with torch.no_grad():
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.mul_(0.1)
peft_model.save_pretrained(adapter)
AutoTokenizer.from_pretrained(tiny).save_pretrained(adapter)
print(sum(p.numel() for p in model.parameters()))
"""


def _anon_kib(time_pid: int) -> int:
    """RssAnon of the command /usr/bin/time runs: memory that is not a mapped file."""
    try:
        children = Path(f"/proc/{time_pid}/task/{time_pid}/children").read_text().split()
        status = Path(f"/proc/{children[0]}/status").read_text() if children else ""
    except OSError:
        return 0
    match = re.search(r"RssAnon:\s+(\d+)", status)
    return int(match[1]) if match else 0


def timed(command: list[str]) -> tuple[int, int, float]:
    """(peak RSS KiB from /usr/bin/time -v, peak anonymous RSS KiB sampled every 20 ms, wall seconds)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["/usr/bin/time", "-v", *command], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        anon = 0
        while proc.poll() is None:
            anon = max(anon, _anon_kib(proc.pid))
            time.sleep(0.02)
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{stderr[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)[1])
    return peak, anon, time.perf_counter() - started


def weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def measure(size: str, work: Path) -> dict:
    base, adapter, out = work / f"{size}-base", work / f"{size}-adapter", work / f"{size}-merged"
    for path in (base, adapter, out):
        shutil.rmtree(path, ignore_errors=True)
    build = subprocess.run(
        [PYTHON, "-c", BUILD, str(base), str(adapter), json.dumps(SIZES[size])],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        sys.exit(build.stderr[-3000:])
    params = int(build.stdout.split()[-1])
    command = [str(ROOT / ".venv/bin/lowmem-tpu"), "merge", str(adapter), "--out", str(out), "--dtype", "bfloat16"]
    peak, anon, seconds = timed(command)
    check = json.loads((out / "merge.json").read_text())["check"]
    row = {
        "size": size,
        "parameters": params,
        "weights_bytes": weights_bytes(base),
        "peak_rss_kib": peak,
        "peak_anon_kib": anon,
        "seconds": round(seconds, 1),
        "relative_diff": check["relative_diff"],
        "command": " ".join(["/usr/bin/time", "-v", *command]),
    }
    for path in (base, adapter, out):
        shutil.rmtree(path, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,0.5b,1b", help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lowmem-merge-memory"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    baseline, baseline_anon, _ = timed([PYTHON, "-c", IMPORTS])
    rows = [measure(size, args.work) for size in args.sizes.split(",")]
    gib = 1024**3 / 1024  # KiB per GiB
    print(f"imports alone: peak RSS {baseline / gib:.2f} GiB, of which anonymous {baseline_anon / gib:.2f} GiB\n")
    print(
        "| model | parameters | weights (bf16) | peak RSS | peak anonymous | (anonymous - imports) / weights | time |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        weights = r["weights_bytes"] / 1024
        cells = [
            r["size"],
            f"{r['parameters'] / 1e6:,.1f} M",
            f"{weights / gib:.3f} GiB",
            f"{r['peak_rss_kib'] / gib:.2f} GiB",
            f"{r['peak_anon_kib'] / gib:.2f} GiB",
            f"{(r['peak_anon_kib'] - baseline_anon) / weights:.2f}",
            f"{r['seconds']} s",
        ]
        print("| " + " | ".join(cells) + " |")
    results = {"imports_peak_rss_kib": baseline, "imports_peak_anon_kib": baseline_anon, "runs": rows}
    (args.work / "results.json").write_text(json.dumps(results, indent=2))
    diffs = ", ".join(f"{r['size']} {r['relative_diff']:.1e}" for r in rows)
    print(f"\nmerge check, relative logit difference in bfloat16: {diffs}")


if __name__ == "__main__":
    main()
