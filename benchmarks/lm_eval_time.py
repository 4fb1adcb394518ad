"""How long ``eval --tasks`` takes for a 3B model on the host CPU: lm-eval's requests per second, measured.

    python benchmarks/lm_eval_time.py [--dtype bfloat16] [--limit 20] [--table]

Builds Open Llama 3B v2 from its shipped config.json with random weights (time per request does not depend on
the weights) in ``--dtype`` (bfloat16: what the TPU recipes train and ``eval`` loads), with the
Open-Llama-shaped sentencepiece tokenizer of the tests, and runs the ``builtin:reverse`` tasks through
lm-eval's Hugging Face model class exactly as ``eval --tasks`` does (``--limit`` documents each: three
log-likelihood requests per multiple-choice document, one greedy generation of at most 8 tokens per
generation document). Writes ``benchmarks/results/lm_eval_time.json``; ``--table`` prints its line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "lm_eval_time.json"
CONFIG = ROOT / "lowmem_tpu" / "model_configs" / "openlm-research__open_llama_3b_v2.json"


def measure(dtype: str, limit: int) -> dict:
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from open_llama_like import TOKENIZER_CONFIG, train_tokenizer

    from lowmem_tpu.infer.harness import BUILTIN_TASKS, write_builtin_tasks

    with tempfile.TemporaryDirectory(prefix="lowmem-lm-eval-time-") as tmp:
        train_tokenizer(Path(tmp) / "tok")
        (Path(tmp) / "tok" / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
        config = AutoConfig.for_model(
            **{k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "architectures"}
        )
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
        built = time.perf_counter() - started
        manager = TaskManager(include_path=str(write_builtin_tasks(Path(tmp))))
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8, device="cpu")
        started = time.perf_counter()
        simple_evaluate(model=lm, tasks=list(BUILTIN_TASKS), task_manager=manager, limit=limit, bootstrap_iters=0)
        seconds = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": "open_llama_3b_v2 (random weights)",
        "parameters": params,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "documents_per_task": limit,
        "loglikelihood_requests": 3 * limit,
        "generation_requests": limit,
        "build_seconds": round(built, 1),
        "eval_seconds": round(seconds, 1),
    }


def table(result: dict) -> str:
    return (
        f"`python benchmarks/lm_eval_time.py`: {result['model']}, {result['parameters'] / 1e9:.2f} B parameters in "
        f"{result['dtype']} on {result['cpus']} CPU cores: {result['loglikelihood_requests']} log-likelihood "
        f"requests and {result['generation_requests']} greedy generations (up to 8 tokens) of the builtin:reverse "
        f"tasks took {result['eval_seconds']:.0f} s "
        f"({result['eval_seconds'] / (result['loglikelihood_requests'] + result['generation_requests']):.1f} s per "
        "request, prompts of about 10 tokens)."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--table", action="store_true", help="print the line of the recorded result and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return 0
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    result = measure(args.dtype, args.limit)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
