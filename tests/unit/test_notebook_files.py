"""The Kaggle and Colab notebooks as shipped: outputs stripped, one parameters cell that CI can replace, the
same code but for the recipe and where each platform keeps the Hub token (running one through a real Jupyter
kernel: e2e/test_notebooks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebook_params import NOTEBOOKS, assigned, ci_parameters

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


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


def test_the_notebooks_run_the_same_code_but_for_the_recipe_and_the_platforms_secrets():
    """So that running one of them end to end (e2e/test_notebooks.py) runs the other's code too."""
    kaggle, colab = (
        [c.source for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code"] for p in NOTEBOOKS[::-1]
    )
    assert len(kaggle) == len(colab)
    platform = ("Kaggle", "kaggle", "Colab", "colab", "UserSecretsClient", "userdata")
    for k, c in zip(kaggle[1:], colab[1:], strict=True):  # the parameters cell is checked above
        differ = [line for line in set(k.splitlines()) ^ set(c.splitlines()) if not any(w in line for w in platform)]
        assert differ == [], differ
