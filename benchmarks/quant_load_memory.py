"""Host memory of loading a checkpoint: transformers' ``from_pretrained`` vs quantizing while reading.

    python benchmarks/quant_load_memory.py [--hidden 1024] [--layers 8]

Saves a random-init Llama (safetensors, float32, Open Llama's proportions at the given width and
depth) once, then loads it in a fresh process per way of loading and samples the process's
resident memory every few milliseconds, in all (VmRSS: file pages of a memory-mapped
checkpoint included) and anonymous (RssAnon: memory the loading allocated itself).
Writes ``outputs/quant_load/quant_load.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path("outputs/quant_load")
WAYS = ("from_pretrained", "int8", "int4")

CHILD = r"""
import sys, threading, time, json
import torch

def rss():
    fields = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "VmRSS:")):
            fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["RssAnon"], fields["VmRSS"]

from transformers import AutoConfig, AutoModelForCausalLM
from lowmem_tpu.config import ModelSection
from lowmem_tpu.model import build_base_model

path, way = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(path)
baseline, done = rss(), [False]
peak = list(baseline)

def sample():
    while not done[0]:
        now = rss()
        peak[:] = [max(p, n) for p, n in zip(peak, now)]
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
if way == "from_pretrained":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
else:
    section = ModelSection(name_or_path=path, dtype="float32", attn_implementation="eager", quantize=way)
    model = build_base_model(section)
done[0] = True
thread.join()
held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
anon, total = (p - b for p, b in zip(peak, baseline))
print(json.dumps({"way": way, "peak_anonymous_bytes": anon, "peak_rss_bytes": total, "held_bytes": held}))
"""


def save_model(hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = OUT / f"llama-{hidden}x{layers}"
    if (path / "model.safetensors").exists():
        return path
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 27 // 10 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    path = save_model(args.hidden, args.layers)
    size = (path / "model.safetensors").stat().st_size
    rows = []
    for way in WAYS:
        done = subprocess.run([sys.executable, "-c", CHILD, str(path), way], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (OUT / "quant_load.json").write_text(json.dumps({"checkpoint_bytes": size, "rows": rows}, indent=2) + "\n")
    mib = 2**20
    print(f"checkpoint: {path} ({size / mib:,.0f} MiB, float32)")
    print("| load | peak RSS MiB | peak anonymous MiB | the loaded model holds MiB |\n|---|---|---|---|")
    for row in rows:
        peaks = f"{row['peak_rss_bytes'] / mib:,.0f} | {row['peak_anonymous_bytes'] / mib:,.0f}"
        print(f"| {row['way']} | {peaks} | {row['held_bytes'] / mib:,.0f} |")


if __name__ == "__main__":
    main()
