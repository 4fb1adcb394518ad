"""How many XLA graphs generation compiles, and its tokens/s, on a trained adapter (the demo's by default).

    lowmem-tpu sft output_dir=outputs/tiny_lora_cpu        # the demo, if not trained yet
    python benchmarks/bench_generate.py outputs/tiny_lora_cpu/final --prompts 20 [--device xla|cpu] [--json F]

Loads the model once, completes ``--prompts`` held-out prompts one by one (greedy, up to 16 new
tokens) and reports the graphs compiled after the first prompt and after all of them, with
tokens/s of all but the first (its time includes compiling), and exact match against the answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--device", default="xla")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from lowmem_tpu.infer.session import Options, Session

    session = Session(args.directory, Options(max_new_tokens=16, device=args.device))
    lines = (ROOT / "lowmem_tpu/assets/reverse/eval.jsonl").read_text().splitlines()[: args.prompts]
    pairs = [(m["messages"][0]["content"], m["messages"][1]["content"]) for m in map(json.loads, lines)]
    results, graphs_after_first = [], None
    started = time.perf_counter()
    for i, (prompt, expected) in enumerate(pairs):
        text, generation = session.complete(prompt)
        results.append((text == expected, generation))
        if i == 0:
            graphs_after_first = session.graphs
    steady = [g for _, g in results[1:]]
    tokens = sum(len(g.ids) for g in steady)
    seconds = sum(g.seconds for g in steady)
    report = {
        "device": args.device,
        "prompts": len(pairs),
        "graphs_after_first_prompt": graphs_after_first,
        "graphs_after_all": session.graphs,
        "first_prompt_seconds": round(results[0][1].seconds, 2),
        "steady_tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "exact_match": sum(ok for ok, _ in results) / len(results),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
