"""The Kaggle and Colab notebooks, top to bottom, through a real Jupyter kernel (this venv's Python) on the
CPU backend: the parameters cell is replaced (papermill style) by the tiny recipe, a few steps, no install
and a dry-run push; every other cell runs as shipped."""

from __future__ import annotations

import ast
import json
import struct
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "lowmem-tpu-test"


def ci_parameters(out: Path) -> str:
    overrides = [
        f"output_dir={out}",
        "train.max_steps=4",
        "train.logging_steps=1",
        "train.global_batch_size=16",
        "train.warmup_steps=1",
        "train.eval_samples=0",  # no exact-match generation, no eval set: fewer graphs to compile
        "data.eval_path=null",
    ]
    return "\n".join(
        [
            'REPO_URL = ""',
            "INSTALL = False",
            f"RECIPE = {str(ROOT / 'recipes' / 'tiny_lora_cpu.yaml')!r}",
            f"OVERRIDES = {overrides!r}",
            "OVERWRITE = False",
            'DOCTOR_ARGS = ["--skip-train"]',
            "REFRESH_SECONDS = 1",
            'PROMPT = "reverse laltq"',
            "MAX_NEW_TOKENS = 6",
            "MERGE = True",
            'PUSH_REPO = "ci/tiny-notebook"',
            "PUSH_MERGED = True",
            "PUSH_PRIVATE = True",
            "PUSH_DRY_RUN = True",
        ]
    )


def assigned(source: str) -> set[str]:
    return {t.id for node in ast.parse(source).body if isinstance(node, ast.Assign) for t in node.targets}


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


def test_the_shipped_notebooks_are_stripped_and_parameterized():
    assert [p.name for p in NOTEBOOKS] == ["colab_v5e1.ipynb", "kaggle_v5e8.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code), f"{path.name}: outputs not stripped"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and tagged[0] is code[0], path.name
        assert assigned(tagged[0].source) == assigned(ci_parameters(Path("x"))), path.name
        recipe = "open_llama_lora.yaml" if path.name.startswith("kaggle") else "open_llama_lora_v5e1.yaml"
        assert f'RECIPE = "recipes/{recipe}"' in tagged[0].source


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_the_cpu_backend(path, kernel, tmp_path):
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
