"""What each quantized base costs in quality, on a model trained to a real loss: the QLoRA table.

    python benchmarks/quant_quality.py [--minutes 4] [--lora-steps 120] [--table]

A byte-level Llama (vocabulary 256, 4 layers, width 256) is pretrained on the CPU for a few minutes on
Python's own standard library source (shipped with every Python), so its weights carry the structure
quantization error is measured against (random weights would make the comparison meaningless). Then,
for the base in bfloat16 and quantized to int8, int4 (group 64), nf4 (blocks of 64) and nf4 with double
quantization (QLoRA's), each built by the project's own quantizer (``model.quantize``):

- held-out loss on unseen standard-library files (nats per byte),
- a short LoRA fine-tune (PEFT, rank 16, all linear layers) on this repository's docs/ (English prose, a
  new domain), and the held-out loss on docs it did not train on;
- the base's bytes per parameter (packed weights and scales of the quantized linears).

Writes ``benchmarks/results/quant_quality.json``; ``--table`` prints the markdown table from it.

Calibration: the quality each quantized base (int8, int4, nf4, nf4 with double quantization) costs against
bf16, before and after LoRA (the QLoRA table); no doc cites its record yet, and none is committed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "quant_quality.json"
DOCS = Path(__file__).resolve().parents[1] / "docs"
SEQ = 256
BASES = (
    ("bf16", None),
    ("int8", ("int8", 64, False)),
    ("int4", ("int4", 64, False)),
    ("nf4", ("nf4", 64, False)),
    ("nf4 + double quant", ("nf4", 64, True)),
)


def corpus(files: list[Path]):
    import torch

    data = b"\n".join(path.read_bytes() for path in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def stdlib_split() -> tuple[list[Path], list[Path]]:
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 2000)
    return [p for i, p in enumerate(files) if i % 10], [p for i, p in enumerate(files) if i % 10 == 0]


def docs_split() -> tuple[list[Path], list[Path]]:
    files = sorted(DOCS.glob("*.md"))
    return [p for i, p in enumerate(files) if i % 4], [p for i, p in enumerate(files) if i % 4 == 0]


def make_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def batches(data, batch: int, generator):
    import torch

    while True:
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=generator)
        yield torch.stack([data[s : s + SEQ] for s in starts])


def train(model, data, params, steps: int | None, seconds: float | None, lr: float) -> int:
    import torch

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    started, done = time.perf_counter(), 0
    model.train()
    for ids in batches(data, 16, generator):
        if (steps is not None and done >= steps) or (seconds is not None and time.perf_counter() - started > seconds):
            break
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        if done % 100 == 0:
            print(f"  step {done}: loss {loss.item():.3f}", flush=True)
    return done


def held_out_loss(model, data, windows: int = 96) -> float:
    import torch

    model.eval()
    stride = max((len(data) - SEQ - 1) // windows, 1)
    losses = []
    with torch.no_grad():
        for start in range(0, stride * windows, stride):
            ids = data[start : start + SEQ].unsqueeze(0)
            losses.append(model(input_ids=ids, labels=ids).loss.float().item())
    return sum(losses) / len(losses)


def bytes_per_parameter(model) -> float | None:
    from lowmem_tpu.model.quantize import QuantizedLinear

    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return None
    stored = sum(t.numel() * t.element_size() for m in layers for t in (*m.parameters(), *m.buffers()))
    return stored / sum(m.in_features * m.out_features for m in layers)


def quantized(base, spec):
    import torch

    from lowmem_tpu.model.quantize import QuantSpec, quantize_model

    model = copy.deepcopy(base).to(torch.bfloat16)
    if spec is not None:
        quantize_model(model, QuantSpec(*spec))
    return model


def fine_tune(model, train_data, steps: int):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    train(peft, train_data, [p for p in peft.parameters() if p.requires_grad], steps, None, lr=2e-3)
    return peft


def run(minutes: float, lora_steps: int) -> dict:
    import torch

    torch.set_num_threads(2)
    code_train, code_eval = (corpus(files) for files in stdlib_split())
    docs_train, docs_eval = (corpus(files) for files in docs_split())
    print(f"pretraining on {len(code_train) / 1e6:.1f} MB of the standard library for {minutes} min", flush=True)
    base = make_model()
    steps = train(base, code_train, list(base.parameters()), None, minutes * 60, lr=2e-3)
    rows = []
    for name, spec in BASES:
        print(f"{name}: held-out loss, then {lora_steps} LoRA steps on docs/", flush=True)
        model = quantized(base, spec)
        row = {
            "base": name,
            "bytes_per_parameter": bytes_per_parameter(model),
            "code_loss": held_out_loss(model, code_eval),
            "docs_loss_before": held_out_loss(model, docs_eval),
        }
        row["docs_loss_after_lora"] = held_out_loss(fine_tune(model, docs_train, lora_steps), docs_eval)
        rows.append(row)
        print(f"  {row}", flush=True)
    return {
        "command": "python benchmarks/quant_quality.py " + " ".join(sys.argv[1:]),
        "model": "byte-level Llama, 4 layers, width 256, 4 heads, MLP 704; pretrained in fp32",
        "pretraining": {"minutes": minutes, "steps": steps, "batch": 16, "length": SEQ, "bytes": len(code_train)},
        "lora": {"steps": lora_steps, "rank": 16, "alpha": 32, "target_modules": "all-linear", "lr": 2e-3},
        "loss_unit": "nats per byte",
        "rows": rows,
    }


def table(result: dict) -> str:
    bf16 = result["rows"][0]
    lines = [
        "| base | bytes / parameter | held-out code loss | (vs bf16) | docs loss after LoRA | (vs bf16) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        size = "2 (bf16)" if row["bytes_per_parameter"] is None else f"{row['bytes_per_parameter']:.3f}"
        code, docs = row["code_loss"], row["docs_loss_after_lora"]
        lines.append(
            f"| {row['base']} | {size} | {code:.4f} | {code - bf16['code_loss']:+.4f} | {docs:.4f} | "
            f"{docs - bf16['docs_loss_after_lora']:+.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="pretraining time on the CPU")
    parser.add_argument("--lora-steps", type=int, default=120)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return
    result = run(args.minutes, args.lora_steps)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {RESULT}; perplexity of bf16 on held-out code: {math.exp(result['rows'][0]['code_loss']):.2f}")


if __name__ == "__main__":
    main()
