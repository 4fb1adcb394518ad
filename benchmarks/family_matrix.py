"""Every model family's stand-in through the whole flow, by the CLI a user runs, on the CPU backend.

    .venv/bin/python benchmarks/family_matrix.py [--only llama3 qwen3 ...] [--steps 100] [--out FILE] [--table]

For each family's stand-in, the test suite's, built by its command (``python tests/helpers/families.py NAME
DIR``: its config.json as the Hub has it, shrunk, random weights; its tokenizer kind, special tokens, EOS list
and chat template, tests/helpers/family_tokenizers.py):

1. ``sft`` LoRA on two-turn chat data (reverse a word, then another) with the family's own template:
   user turns masked, held-out greedy exact match before and after;
2. ``merge`` (it checks the merged model against base + adapter itself), then the merged model loaded by
   plain transformers and its logits compared with PEFT's base + adapter here;
3. ``generate`` on a held-out prompt: the reply, and whether decoding stopped at an end id;
4. ``eval`` of the adapter: the numbers ``sft`` reported after training;
5. ``sft`` for a few steps with full fine-tuning, and LoRA on an int8 and on an int4 base;
6. resume: 8 LoRA steps uninterrupted, and the same run stopped by SIGTERM after step 3 and run again
   (``--resume-only`` runs this part alone);
7. QLoRA (``--qlora-only`` runs this part alone): LoRA on an NF4 base (double quantization, bfloat16) resumed
   as in 6., merged as trained (into the dequantized weights), and ``generate`` on the merged model against
   ``generate`` on the adapter over the quantized base.

Writes the results as JSON (``--out``, benchmarks/results/family_matrix.json by default) and prints a table
(``--table``: the table alone, from ``--out``).
Takes about 2 minutes per family here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ROOT / "tests" / "helpers" / "families.py"  # the stand-ins, run as a command (nothing of tests/ imported)

WORDS = ["lemon", "paris", "bread", "stone", "river", "cloud", "apple", "tiger", "piano", "queen", "zebra", "mango"]


def stand_ins() -> dict[str, str]:
    """Every stand-in's name and the text that ends its assistant turn."""
    listed = subprocess.run([sys.executable, str(FAMILIES)], capture_output=True, text=True, timeout=600)
    return json.loads(checked(listed, "the stand-ins' list").stdout)


def make_family(path: Path, name: str) -> Path:
    """The family's stand-in built in ``path`` (config.json, weights, generation_config, tokenizer)."""
    command = [sys.executable, str(FAMILIES), name, str(path)]
    checked(subprocess.run(command, capture_output=True, text=True, timeout=600), f"the {name} stand-in")
    return path


def conversations(seed: int, n: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"reverse {a}"},
                    {"role": "assistant", "content": a[::-1]},
                    {"role": "user", "content": f"reverse {b}"},
                    {"role": "assistant", "content": b[::-1]},
                ]
            }
        )
    return out


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cli(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    command = [sys.executable, "-m", "lowmem_tpu.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env | {"HF_HUB_OFFLINE": "1"}, timeout=timeout)


def checked(proc: subprocess.CompletedProcess[str], what: str) -> subprocess.CompletedProcess[str]:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def sft_args(model: Path, train: str, evals: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "sft",
        "recipes/tiny_lora_cpu.yaml",
        f"model.name_or_path={model}",
        "model.random_init=false",
        "model.pad_token=null",
        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        f"data.path={train}",
        f"data.eval_path={evals}",
        "data.max_length=96",
        f"train.max_steps={steps}",
        f"train.warmup_steps={max(steps // 10, 1)}",
        f"train.logging_steps={max(steps // 5, 1)}",
        "train.eval_samples=24",
        "train.max_new_tokens=12",
        f"output_dir={out}",
        *extra,
    ]


def resume_check(model: Path, train: str, evals: str, work: Path, *more: str) -> dict:
    """8 LoRA steps uninterrupted; the same run stopped by SIGTERM after step 3, then the same command again:
    the resumed run's losses and final adapter against the uninterrupted run's."""
    import signal

    from safetensors.torch import load_file

    extra = ("train.save_steps=2", "train.logging_steps=1", "train.eval_samples=0", *more)
    whole = work / "whole"
    checked(cli(*sft_args(model, train, evals, whole, 8, *extra)), "sft uninterrupted")
    out = work / "stopped"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    env["PYTHONUNBUFFERED"] = "1"  # each step's line as it is printed: the signal lands mid-run
    command = [sys.executable, "-m", "lowmem_tpu.cli", *sft_args(model, train, evals, out, 8, *extra)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("step 3/8"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=600)
    checked(cli(*sft_args(model, train, evals, out, 8, *extra)), "sft resumed")

    def losses(run: Path) -> dict[int, float]:
        logged = json.loads((run / "final" / "metrics.json").read_text())["train"]["losses"]
        return {e["step"]: e["loss"] for e in logged}

    before, after = losses(whole), losses(out)
    a = load_file(str(whole / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    return {
        "stopped_with": proc.returncode,
        "resumed_steps": sorted(after),
        "max_loss_gap": max(abs(loss - before[step]) for step, loss in after.items()),
        "max_adapter_gap": max(float((a[k] - b[k]).abs().max()) for k in a),
    }


NF4 = ("model.quantize=nf4", "model.quantize_group_size=32", "model.dtype=bfloat16")


def qlora_check(model: Path, train: str, evals: str, work: Path) -> dict:
    """LoRA on an NF4 base: exact resume, the merge as trained, and the merged model's greedy reply against the
    adapter's on the quantized base."""
    result = {"resume": resume_check(model, train, evals, work, *NF4)}
    final, merged = work / "stopped" / "final", work / "qlora-merged"
    done = checked(cli("merge", str(final), "--out", str(merged), "--dtype", "bfloat16"), "merge nf4")
    check = json.loads((merged / "merge.json").read_text())["check"]
    result["merge"] = {"against": check["against"], "relative_diff": check["relative_diff"], "exit": done.returncode}
    replies = {}
    for what, directory in (("adapter", final), ("merged", merged)):
        out = checked(cli("generate", str(directory), "--prompt", "reverse mango", "--max-new-tokens", "16"), what)
        replies[what] = out.stdout.strip()
    result["generate"] = replies | {"same": replies["adapter"] == replies["merged"]}
    return result


def logits_gap(model: Path, adapter: Path, merged: Path, text: str) -> float:
    """Max |logit| difference between the merged model and PEFT's base + adapter, both in plain transformers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(adapter)(text, return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        reference = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    return float((got - reference).abs().max())


def family(name: str, end_of_turn: str | None, work: Path, steps: int) -> dict:
    model = make_family(work / "model", name)  # with the family's tokenizer
    train = write_jsonl(work / "train.jsonl", conversations(0, 512))
    evals = write_jsonl(work / "eval.jsonl", conversations(1, 64))  # one batch at least: a partial one is dropped
    result: dict = {"family": name, "end_of_turn": end_of_turn}
    started = time.perf_counter()
    checked(cli(*sft_args(model, train, evals, work / "lora", steps, "train.learning_rate=3e-3")), "sft lora")
    metrics = json.loads((work / "lora" / "final" / "metrics.json").read_text())
    result["lora"] = {
        "exact_match_before": metrics["eval"]["before"].get("exact_match"),
        "exact_match_after": metrics["eval"]["after"].get("exact_match"),
        "final_loss": metrics["train"]["losses"][-1]["loss"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    final = work / "lora" / "final"
    merged = work / "merged"
    checked(cli("merge", str(final), "--out", str(merged), "--dtype", "float32"), "merge")
    prompt = "reverse mango"
    rendered = json.loads((work / "eval.jsonl").read_text().splitlines()[0])["messages"][:1]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(final).apply_chat_template(
        rendered, tokenize=False, add_generation_prompt=True
    )
    result["merge_max_logit_gap"] = logits_gap(model, final, merged, text)
    generated = checked(cli("generate", str(final), "--prompt", prompt, "--max-new-tokens", "16", "--verbose"), "gen")
    result["generate"] = {
        "prompt": prompt,
        "reply": generated.stdout.strip().splitlines()[0] if generated.stdout else "",
    }
    result["generate"]["stopped"] = "eos" if "(eos)" in generated.stdout + generated.stderr else "length"
    scores = json.loads(checked(cli("eval", str(final), "--data", evals, "--json"), "eval").stdout)
    result["eval"] = {"loss": scores.get("loss"), "exact_match": scores.get("exact_match")}
    for mode, extra in (
        ("full", ["lora.enabled=false", "train.learning_rate=1e-3"]),
        ("int8", ["model.quantize=int8", "model.dtype=bfloat16"]),
        ("int4", ["model.quantize=int4", "model.quantize_group_size=32", "model.dtype=bfloat16"]),
    ):
        proc = cli(*sft_args(model, train, evals, work / mode, 4, "train.eval_samples=0", *extra))
        losses = []
        if proc.returncode == 0:
            losses = [
                e["loss"] for e in json.loads((work / mode / "final" / "metrics.json").read_text())["train"]["losses"]
            ]
        result[mode] = {
            "exit": proc.returncode,
            "losses": losses,
            "error": proc.stderr[-400:] if proc.returncode else None,
        }
    return result


def _qlora_cell(qlora: dict | None) -> str:
    if not qlora:
        return "not run"
    if "error" in qlora:
        return f"error: {qlora['error'][:60]}"
    resume, merge = qlora["resume"], qlora["merge"]
    same = "same reply" if qlora["generate"]["same"] else "replies differ"
    return f"loss gap {resume['max_loss_gap']:.0e}; merge {merge['relative_diff']:.0e} vs nf4 base; {same}"


def table(recorded: dict) -> str:
    """The results as a Markdown table."""
    rows = [
        "| family | end of turn | exact match before -> after | merge gap | generate | full | int8 | int4 | resume "
        "| nf4: resume, merge as trained, merged generates alike |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in recorded.items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error'][:80]} | | | | | | | | |")
            continue
        lora, reply = r["lora"], r["generate"]
        modes = [("ok" if r[m]["exit"] == 0 else f"exit {r[m]['exit']}") for m in ("full", "int8", "int4")]
        resume = r.get("resume")
        if resume and "error" in resume:
            modes.append(f"error: {resume['error'][:60]}")
        elif resume:
            steps = resume["resumed_steps"]
            modes.append(f"steps {steps[0]}-{steps[-1]} again, loss gap {resume['max_loss_gap']:.0e}")
        else:
            modes.append("not run")
        modes.append(_qlora_cell(r.get("qlora")))
        rows.append(
            f"| {name} | `{r['end_of_turn']!r}` | {lora['exact_match_before']:.2f} -> {lora['exact_match_after']:.2f} "
            f"| {r['merge_max_logit_gap']:.1e} | {reply['reply']!r} ({reply['stopped']}) | {' | '.join(modes)} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "family_matrix.json")
    parser.add_argument("--table", action="store_true", help="print the table of --out and run nothing")
    parser.add_argument("--resume-only", action="store_true", help="run only the resume check, into --out")
    parser.add_argument("--qlora-only", action="store_true", help="run only the NF4 QLoRA check, into --out")
    args = parser.parse_args()
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    families = {} if args.table else stand_ins()
    names = [n for n in families if args.only is None or n in args.only]
    for name in names:
        print(f"[{name}]", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix=f"lowmem-family-{name}-") as tmp:
            if args.resume_only or args.qlora_only:
                model = make_family(Path(tmp) / "model", name)
                train = write_jsonl(Path(tmp) / "train.jsonl", conversations(0, 512))
                evals = write_jsonl(Path(tmp) / "eval.jsonl", conversations(1, 64))
                part, check = ("qlora", qlora_check) if args.qlora_only else ("resume", resume_check)
                try:
                    found = check(model, train, evals, Path(tmp))
                except RuntimeError as err:
                    found = {"error": str(err)}
                recorded[name] = recorded.get(name, {"family": name}) | {part: found}
            else:
                try:
                    recorded[name] = family(name, families[name], Path(tmp), args.steps)
                except RuntimeError as err:
                    recorded[name] = {"family": name, "error": str(err)}
        print(json.dumps(recorded[name])[:600], file=sys.stderr, flush=True)
        args.out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(table(recorded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
