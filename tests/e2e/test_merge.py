"""``lowmem-tpu merge`` on a tiny random-init Llama and a PEFT adapter: equivalence, files, and every refusal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import make_adapter, make_base

from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lowmem_tpu.publish.merge import MERGE_REPORT, merge_adapter
from lowmem_tpu.publish.verify import PROMPTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = make_base(root / "base")
    return base, make_adapter(base, root / "adapter")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lowmem_tpu.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def reference_logits(base: Path, adapter: Path) -> list[torch.Tensor]:
    """base + adapter, unmerged, computed here independently of lowmem_tpu.merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt")).logits for text in PROMPTS]


def assert_untouched(out: Path) -> None:
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def test_merged_model_equals_base_plus_adapter(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, adapter = tiny
    out = tmp_path / "merged"
    result = merge_adapter(adapter, out, dtype="float32", max_shard_size="1MB")

    files = {p.name for p in out.iterdir()}
    shards = sorted(name for name in files if name.startswith("model-") and name.endswith(".safetensors"))
    assert len(shards) >= 2 and "model.safetensors.index.json" in files  # sharded above the size limit
    assert {"config.json", "generation_config.json", "tokenizer.json", MERGE_REPORT, "recipe.yaml"} <= files
    assert ADAPTER_CONFIG not in files and ADAPTER_WEIGHTS not in files
    assert_untouched(tmp_path / "other")  # no partial sibling left behind

    report = json.loads((out / MERGE_REPORT).read_text())
    assert report["check"]["passed"] and report["check"]["tolerance"] == 1e-4
    assert report["check"]["relative_diff"] <= 1e-4
    assert report["check"] == result.check and report["dtype"] == "float32" and not report["forced_base"]

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.config.use_cache and merged.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        got = [merged(**tokenizer(text, return_tensors="pt")).logits for text in PROMPTS]
    for ref, new in zip(reference_logits(base, adapter), got, strict=True):
        torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-4)

    # The merge really changed every targeted weight, and nothing else.
    before = load_file(base / "model.safetensors")
    after = merged.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if k.endswith("proj.weight")}


def test_cli_merges_in_bfloat16_by_default(tiny, tmp_path):
    _, adapter = tiny
    out = tmp_path / "served"
    result = cli("merge", str(adapter), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "merged model written to" in result.stdout
    report = json.loads((out / MERGE_REPORT).read_text())
    assert report["dtype"] == "bfloat16" and report["check"]["passed"]
    assert report["check"]["tolerance"] == 5e-2 and report["check"]["relative_diff"] <= 5e-2
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict) == {"BF16"}


def test_cli_refuses_a_directory_without_adapter_files(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    result = cli("merge", str(tmp_path / "empty"), "--out", str(out))
    assert result.returncode == 2
    assert "missing adapter_config.json, adapter_model.safetensors" in result.stderr
    assert "Traceback" not in result.stderr
    assert_untouched(out)


def test_refuses_a_full_model(tiny, tmp_path):
    base, _ = tiny
    with pytest.raises(UserError, match="holds a full model, not a LoRA adapter"):
        merge_adapter(base, tmp_path / "out")


def test_refuses_a_base_whose_shapes_differ(tiny, tmp_path):
    _, adapter = tiny
    other = make_base(tmp_path / "small", hidden_size=64, intermediate_size=192)
    with pytest.raises(UserError) as err:
        merge_adapter(adapter, tmp_path / "out", base=str(other), force=True)
    problems = err.value.problems
    assert problems[0].startswith("the base does not match the adapter")
    line = "model.layers.0.mlp.down_proj: the adapter expects a base weight of shape (128, 256) "
    assert line + "(lora_B (128, 4) x lora_A (4, 256)), the base has (64, 192)" in problems
    assert problems[-1].startswith("... and ")  # capped list
    assert_untouched(tmp_path / "out")


def test_refuses_another_base_or_revision_unless_forced(tiny, tmp_path):
    base, adapter = tiny
    copy = shutil.copytree(base, tmp_path / "moved-base")
    with pytest.raises(UserError, match=r"is not the base the adapter was trained on .*pass --force"):
        merge_adapter(adapter, tmp_path / "out", base=str(copy))
    with pytest.raises(UserError, match=r"--revision v2 is not the revision the adapter was trained on \(main\)"):
        merge_adapter(adapter, tmp_path / "out", revision="v2")
    assert_untouched(tmp_path / "out")
    result = merge_adapter(adapter, tmp_path / "out", base=str(copy), dtype="float32", force=True)
    assert json.loads((result.out / MERGE_REPORT).read_text())["forced_base"] is True


def test_refuses_a_non_empty_out_unless_forced(tiny, tmp_path):
    _, adapter = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=r"exists and is not empty; .* pass --force"):
        merge_adapter(adapter, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(UserError, match="overlaps"):
        merge_adapter(adapter, adapter / "merged", force=True)
    merge_adapter(adapter, out, dtype="float32", force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_refuses_an_adapter_with_nan(tiny, tmp_path):
    _, adapter = tiny
    broken = shutil.copytree(adapter, tmp_path / "broken")
    tensors = load_file(broken / ADAPTER_WEIGHTS)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, broken / ADAPTER_WEIGHTS)
    with pytest.raises(UserError, match=r"hold NaN or Inf .*the adapter is broken"):
        merge_adapter(broken, tmp_path / "out")
    assert_untouched(tmp_path / "out")


def test_merge_refuses_a_live_runs_directory_and_another_merges_out_and_holds_its_own(tiny, tmp_path):
    """``--out`` a live run's output_dir, its final/ or below it, or where another merge writes: exit 2 naming
    the process; a killed holder blocks nothing; a merge holds its ``--out`` while it writes."""
    import signal
    import time

    from lowmem_tpu.files import LOCK

    _, adapter = tiny
    run, out = (tmp_path / "run").resolve(), (tmp_path / "merged").resolve()

    def hold(directory: Path, how: str) -> subprocess.Popen[str]:
        code = f"from pathlib import Path\nfrom lowmem_tpu.files import {how}\n"
        code += f"with {how}(Path({str(directory)!r}), 'x'):\n"
        code += "    print('held', flush=True)\n    import time; time.sleep(600)\n"
        holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        return holder

    live, other = hold(run, "holding"), hold(out, "holding_output")  # a training run (as sft holds it), a merge
    try:
        for target, holder, held in ((run, live, run), (run / "final", live, run), (out, other, out)):
            refused = cli("merge", str(adapter), "--out", str(target))
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
            assert f"--out: {held} is in use by lowmem-tpu (pid {holder.pid} on" in refused.stderr
        assert [p.name for p in run.iterdir()] == [LOCK]  # nothing written into the live run's directory
    finally:
        for holder in (live, other):
            holder.send_signal(signal.SIGKILL)
            holder.wait()

    # The killed merge left out/ holding its lock file alone: no content, no lock, nothing refused.
    env = {**os.environ, "PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lowmem_tpu.cli", "merge", str(adapter), "--out", str(out)]
    merging = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = False
    while merging.poll() is None:
        lock = out / LOCK
        seen = seen or (lock.is_file() and f"pid {merging.pid} on" in lock.read_text())
        time.sleep(0.05)
    assert merging.returncode == 0, merging.stderr.read()[-2000:]
    assert seen, "the merge never held its --out"
    assert (out / "model.safetensors").is_file() and not (out / LOCK).exists()
    into_run = cli("merge", str(adapter), "--out", str(run / "merged"))  # a finished run's directory
    assert into_run.returncode == 0, into_run.stderr[-2000:]
