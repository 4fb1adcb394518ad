"""The demo's trained model as GGUF, answered by llama.cpp itself: the same greedy answers as ``lowmem-tpu generate``?

    python benchmarks/gguf_demo.py [--run DIR] [--prompts 100] [--table]

Trains ``recipes/tiny_lora_cpu.yaml`` into a temporary run (unless ``--run`` names a finished one), exports it
with ``lowmem-tpu export RUN --gguf f16,q8_0`` (the adapter merged into its base, each file read back by
transformers and llama.cpp), then answers the first ``--prompts`` held-out prompts three ways, greedily, at
most 6 new tokens: ``lowmem-tpu generate``'s decoder on plain CPU PyTorch, and llama.cpp
(``llama-cpp-python``, the ``gguf`` extra) on each file, given the chat-rendered prompt as text (its own
tokenizer). Records how often llama.cpp's answer equals generate's, each one's exact match against the
reversed word, the files' sizes and the export's logit figures, in ``benchmarks/results/gguf_demo.json``;
``--table`` prints the markdown table of that file. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "gguf_demo.json"
TYPES = ("f16", "q8_0")


def prompts(n: int) -> list[tuple[str, str]]:
    lines = (ROOT / "lowmem_tpu" / "assets" / "reverse" / "eval.jsonl").read_text().splitlines()[:n]
    pairs = [json.loads(line)["messages"] for line in lines]
    return [(m[0]["content"], m[1]["content"]) for m in pairs]


def generate_answers(final: Path, cases: list[tuple[str, str]]) -> list[str]:
    from lowmem_tpu.infer.session import Options, Session

    session = Session(final, Options(max_new_tokens=6, device="cpu"))
    return [session.complete(prompt)[0].strip() for prompt, _ in cases]


def llama_cpp_answers(path: Path, tokenizer, cases: list[tuple[str, str]]) -> list[str]:
    from lowmem_tpu.publish.gguf import llama_cpp

    model = llama_cpp.load(path, 64)  # as export's check loads it (plain CPU buffers: no AMX repacking)
    answers = []
    for prompt, _ in cases:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # llama.cpp puts BOS first itself (the file says the tokenizer adds it): a template's own would be a
        # second one, which generate never sends either (one BOS, as training rendered the prompt).
        text = text.removeprefix(tokenizer.bos_token or "")
        out = model.create_completion(text, max_tokens=6, temperature=0.0, top_k=1, stop=[tokenizer.eos_token])
        answers.append(out["choices"][0]["text"].strip())
    model.close()
    return answers


def measure(run: Path, n: int) -> dict:
    import llama_cpp

    from lowmem_tpu.infer.load import load_trained

    cases = prompts(n)
    out = run / "gguf-demo"
    started = time.perf_counter()
    cli = [sys.executable, "-m", "lowmem_tpu.cli", "export", str(run), "--gguf", ",".join(TYPES), "--out", str(out)]
    subprocess.run([*cli, "--force"], cwd=ROOT, check=True, capture_output=True, text=True)
    export_seconds = time.perf_counter() - started
    report = json.loads((out / "gguf.json").read_text())
    ours = generate_answers(run / "final", cases)
    tokenizer = load_trained(run / "final").tokenizer
    result = {
        "prompts": len(cases),
        "llama_cpp_python": llama_cpp.__version__,
        "export_seconds": round(export_seconds, 1),
        "merged_weight_bytes": report["source_weight_bytes"],
        "generate_exact_match": sum(a == b for a, (_, b) in zip(ours, cases, strict=True)) / len(cases),
        "files": {},
    }
    for name, entry in report["files"].items():
        theirs = llama_cpp_answers(out / name, tokenizer, cases)
        result["files"][entry["type"]] = {
            "file": name,
            "bytes": entry["bytes"],
            "logits_relative_diff": {reader: c["relative_diff"] for reader, c in entry["check"].items()},
            "same_answer_as_generate": sum(a == b for a, b in zip(theirs, ours, strict=True)) / len(cases),
            "exact_match": sum(a == b for a, (_, b) in zip(theirs, cases, strict=True)) / len(cases),
            "examples": [
                {"prompt": p, "generate": g, "llama.cpp": t} for (p, _), g, t in zip(cases, ours, theirs, strict=True)
            ][:3],
        }
    return result


def table(result: dict) -> str:
    lines = [
        f"`python benchmarks/gguf_demo.py`: the demo's adapter merged and exported with `lowmem-tpu export RUN "
        f"--gguf f16,q8_0` ({result['export_seconds']:.0f} s, both files read back and checked), then "
        f"{result['prompts']} held-out prompts answered greedily by `lowmem-tpu generate` (exact match "
        f"{result['generate_exact_match']:.2f}) and by llama.cpp (llama-cpp-python {result['llama_cpp_python']}) "
        "on each file:",
        "",
        "| file | size | logits vs the model (transformers / llama.cpp) | llama.cpp's answer = generate's | "
        "llama.cpp exact match |",
        "|---|---|---|---|---|",
    ]
    merged = result["merged_weight_bytes"] / 2**20
    for qtype, f in result["files"].items():
        diff = f["logits_relative_diff"]
        lines.append(
            f"| {f['file']} ({qtype}) | {f['bytes'] / 2**20:.2f} MiB (merged float32: {merged:.2f} MiB) | "
            f"{diff['transformers']:.1e} / {diff['llama.cpp']:.1e} | {f['same_answer_as_generate']:.2f} | "
            f"{f['exact_match']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a finished demo run (default: train one)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--table", action="store_true", help="print the table of the recorded result and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return 0
    with tempfile.TemporaryDirectory(prefix="lowmem-gguf-demo-") as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            print("training the demo...", file=sys.stderr, flush=True)
            cli = [sys.executable, "-m", "lowmem_tpu.cli", "sft", "recipes/tiny_lora_cpu.yaml", f"output_dir={run}"]
            subprocess.run(cli, cwd=ROOT, check=True, capture_output=True, text=True)
        print("exporting and answering...", file=sys.stderr, flush=True)
        result = measure(run, args.prompts)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
