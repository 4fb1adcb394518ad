"""The shipped notebooks and the parameters cell CI runs them with (test_notebook_files, test_notebooks)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


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
