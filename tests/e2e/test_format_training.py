"""Each data format people bring trains through the shipped recipe on the Open-Llama-like model (4 CPU XLA
devices), and ``lowmem-tpu data`` shows what is trained and what is cut (the rows themselves: unit/test_formats.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from format_records import CONVERSATIONAL, DOLLY, PROMPT_COMPLETION, SHAREGPT, write

from lowmem_tpu.config import load_recipe


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "records", "extra"),
    [
        ("prompt_completion", PROMPT_COMPLETION * 4, []),
        ("prompt_completion", CONVERSATIONAL * 4, ["data.chat_template=plain"]),
        ("sharegpt", SHAREGPT * 4, []),
        ("alpaca", DOLLY * 4, ["data.columns={instruction: instruction, input: context, output: response}"]),
    ],
)
def test_each_format_trains_through_the_shipped_recipe(model_dir, tmp_path, fmt, records, extra):
    from lowmem_tpu.run import run_training

    data = write(tmp_path / f"{fmt}.jsonl", records)
    local = [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={model_dir}", f"data.path={data}"]
    local += ["runtime.device=cpu", "runtime.num_cpu_devices=4", "data.max_length=128", "train.global_batch_size=8"]
    local += ["model.attn_implementation=chunked", "data.packing=false"]  # the recipe's flash is the TPU's; a row each
    local += ["train.gradient_accumulation_steps=2"]  # 8 rows on 4 devices: 1 row in each of 2 micro-batches
    local += [
        "train.max_steps=2",
        "train.logging_steps=1",
        "train.warmup_steps=0",
        "train.save_steps=null",
        "train.max_wall_time=null",
        "runtime.compile_cache_dir=null",
    ]
    run = run_training(load_recipe("recipes/open_llama_lora.yaml", [f"data.format={fmt}", *local, *extra]))
    losses = [e["loss"] for e in run.metrics["train"]["losses"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert run.metrics["data"]["rows"] == 16 and run.metrics["data"]["dropped"] == 0


def test_the_data_command_shows_what_is_trained_and_what_is_cut(model_dir, tmp_path):
    import subprocess
    import sys

    records = [{**r, "response": r["response"] * (40 if i == 1 else 1)} for i, r in enumerate(DOLLY)]  # 2nd: long
    dolly = write(tmp_path / "dolly.jsonl", [*records, {"instruction": "stone " * 80, "context": "", "response": "x"}])
    args = ["recipes/open_llama_lora.yaml", f"model.name_or_path={model_dir}", f"data.path={dolly}"]
    args += ["data.format=alpaca", "data.columns={instruction: instruction, input: context, output: response}"]
    args += [f"output_dir={tmp_path / 'run'}", "data.max_length=160", "data.packing=false"]
    args += ["model.attn_implementation=chunked"]  # flash (the recipe's, on a TPU) tiles no 160-token row

    def cli(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "lowmem_tpu.cli", "data", *args, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])

    proc = cli("--rows", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "### Response:\n\u27e6nomel</s>\u27e7" in out  # the answer and EOS trained, the prompt not
    assert "--- record 2:" in out and "truncated:" in out and "--- record 3" not in out
    assert (
        "all 5 records -> 4 rows of 160 tokens: 1 truncated, 1 dropped (1 with nothing to train)" in out
    )  # the 5th's answer is cut off
    assert (tmp_path / "run" / "data_cache").is_dir()  # sft reads these rows instead of tokenizing again

    proc = cli("--rows", "1", "--json")
    report = json.loads(proc.stdout)
    [row] = report["rows"]
    assert [text for trained, text in row["spans"] if trained] == ["nomel</s>"] and row["fate"] == "fits"
    assert report["stats"]["dropped_untrained"] == 1 and report["stats"]["lengths"]["max"] > 160

    proc = cli("data.format=chat", "data.columns={}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has: instruction, context, response, category" in proc.stderr
