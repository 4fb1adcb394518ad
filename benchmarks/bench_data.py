"""How long tokenizing Alpaca-sized data takes: the first pass, and the cached pass a rerun or resume gets.

    python benchmarks/bench_data.py [--records 51760] [--max-length 1024] [--fast]

Writes a synthetic Alpaca file of ``--records`` records (alpaca-cleaned has 51,760; lengths drawn
to look like it: instructions of ~15 words, an input on 40% of them, outputs of ~50-250 words),
builds the Open-Llama-shaped tokenizer (``python tests/helpers/open_llama_like.py DIR``, the test suite's
stand-in, run as a command: sentencepiece ``tokenizer.model``, loaded slow unless ``--fast``), then runs
``data.build_dataset`` twice with a cache directory. Prints seconds for each pass, the cache's size and the
peak RSS (what each host of a pod slice holds: every host builds the same rows), then times ``lowmem-tpu
data`` (the preview command, a fresh process) on the same file: when its first rows appear and when its
counts over every record do, into a fresh output_dir and then again from its cache. Writes
``outputs/bench_data/bench_data.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench_data"
# Common English words and a few task verbs, drawn at random: text of about the right shape for a tokenizer.
TEXT = """the of and to in a is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their if has will more when who would no out so
what up can said river stone bread write explain summarize give three reasons list describe compare"""
WORDS = re.findall(r"\w+", TEXT)


def synthetic(records: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."

    return [
        {
            "instruction": words(6, 24),
            "input": words(5, 40) if rng.random() < 0.4 else "",
            "output": words(20, 250),
        }
        for _ in range(records)
    ]


def build_open_llama_like(model: Path) -> None:
    """The Open-Llama-shaped directory, built by the test suite's stand-in as a command (nothing imported)."""
    import subprocess

    subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "open_llama_like.py"), str(model)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=51_760)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--fast", action="store_true", help="the fast (Rust) tokenizer instead of the slow one")
    args = parser.parse_args()
    from lowmem_tpu.config import DataSection, ModelSection
    from lowmem_tpu.console import quiet_python_warnings
    from lowmem_tpu.data import build_dataset
    from lowmem_tpu.model import load_tokenizer

    quiet_python_warnings()
    OUT.mkdir(parents=True, exist_ok=True)
    data = OUT / f"alpaca-{args.records}.json"
    data.write_text(json.dumps(synthetic(args.records)))
    model = OUT / "open_llama_like"
    if not (model / "tokenizer.model").exists():
        build_open_llama_like(model)
    tokenizer = load_tokenizer(ModelSection(name_or_path=str(model), use_fast_tokenizer=args.fast, pad_token="<unk>"))
    cfg = DataSection(path=str(data), format="alpaca", max_length=args.max_length)
    cache = OUT / "cache"
    if cache.exists():
        import shutil

        shutil.rmtree(cache)
    timings = {}
    for name in ("first", "cached"):
        started = time.perf_counter()
        _, stats = build_dataset(cfg, tokenizer, cache_dir=cache)
        timings[name] = round(time.perf_counter() - started, 1)
        print(f"{name:>6} pass: {timings[name]:7.1f} s  ({stats['rows']:,} rows, cached={stats['cached']})", flush=True)
    result = {
        "records": args.records,
        "max_length": args.max_length,
        "tokenizer": "fast" if args.fast else "slow (sentencepiece)",
        "seconds": timings,
        "stats": stats,
        "cache_bytes": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()),
        # What each host of a pod slice holds: every host builds (or reads) the same rows.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(f"cache {result['cache_bytes'] / 2**30:.2f} GiB, peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")
    result["preview_seconds"] = preview_times(model, data, args.max_length)
    (OUT / "bench_data.json").write_text(json.dumps(result, indent=2) + "\n")


def preview_times(model: Path, data: Path, max_length: int) -> dict[str, dict[str, float]]:
    """Seconds from the start of ``lowmem-tpu data`` to its first shown row and to its counts, twice."""
    import shutil
    import subprocess

    run_dir = OUT / "preview_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "lowmem_tpu.cli", "data", "recipes/open_llama_lora.yaml", "--rows", "3"]
    command += [f"model.name_or_path={model}", f"data.path={data}", "data.format=alpaca"]
    command += [f"data.max_length={max_length}", f"output_dir={run_dir}"]
    times = {}
    for name in ("fresh", "cached"):
        started, seen = time.perf_counter(), {}
        with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
            for line in proc.stdout:
                key = "first_rows" if line.startswith("--- record 1") else "counts" if line.startswith("all ") else None
                if key:
                    seen[key] = round(time.perf_counter() - started, 1)
        if proc.returncode or len(seen) != 2:
            raise SystemExit(f"lowmem-tpu data failed ({proc.returncode}): {' '.join(command)}")
        times[name] = seen
        print(f"lowmem-tpu data ({name}): first rows after {seen['first_rows']} s, counts after {seen['counts']} s")
    return times


if __name__ == "__main__":
    main()
