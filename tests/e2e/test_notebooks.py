"""The Kaggle notebook, top to bottom, through a real Jupyter kernel (this venv's Python) on the CPU backend: the
parameters cell is replaced (papermill style) by the tiny recipe, a few steps, no install and a dry-run push;
every other cell runs as shipped. The Colab notebook's code is the same but for the recipe and the platform's
secrets (unit/test_notebook_files.py)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from notebook_params import NOTEBOOKS, ci_parameters

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow
KERNEL = "lowmem-tpu-test"


@pytest.fixture
def kernel(tmp_path, monkeypatch) -> str:
    """A kernelspec that starts this interpreter's ipykernel, found first on JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES"):  # as a user's kernel: the recipe picks the backend
        monkeypatch.delenv(name, raising=False)
    return KERNEL


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_kaggle_notebook_runs_on_the_cpu_backend(kernel, tmp_path):
    path = next(p for p in NOTEBOOKS if p.name.startswith("kaggle"))
    nb = nbformat.read(path, as_version=4)
    out = tmp_path / "run"
    parameters = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    parameters.source = ci_parameters(out)
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel, timeout=600, resources={"metadata": {"path": str(tmp_path)}}, allow_errors=False
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{path.name}: a cell failed:\n{str(err)[-4000:]}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = "\n".join(text_of(c) for c in code)
    assert all(o.output_type != "error" for c in code for o in c.outputs)

    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "metrics.json").is_file()
    assert min(png_size(final / "loss.png")) >= 400
    # The live curve: redrawn from metrics.jsonl (to output_dir/loss.png) while sft trained, shown in the cell
    # above the log lines, and at the end replaced by sft's final/loss.png.
    assert min(png_size(out / "loss.png")) >= 400
    train = next(c for c in code if 'run_cli("sft"' in c.source)
    assert [o.output_type for o in train.outputs if "image/png" in o.get("data", {})] == ["display_data"]
    assert "$ lowmem-tpu sft" in text_of(train) and "summary" in text_of(train)
    assert "doctor: every check passed" in outputs or "doctor: a check failed" in outputs
    generate = next(c for c in code if 'run_cli("generate"' in c.source)
    assert text_of(generate).startswith("$ lowmem-tpu generate")  # then the completion (4 steps: maybe empty)
    assert not [o for o in generate.outputs if o.output_type == "execute_result"]
    merged = out / "merged"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    push = next(c for c in code if 'run_cli("push"' in c.source)
    assert "$ lowmem-tpu push" in text_of(push) and "model.safetensors" in text_of(push)
