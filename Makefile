# Commands that work on a fresh machine with Python 3.11 and pip:
#   make demo   - train the embedded default (tiny Llama, LoRA, 4 CPU XLA devices)
#   make check  - lint and the fast lane (tests/unit: no XLA started, no training)
#   make test   - the whole test suite (tests/unit and tests/e2e)
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-$(shell cat constraints.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo check test lint format install install-scan tpu-compile-check clean

install: $(STAMP)

$(STAMP): constraints.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# [dev] builds llama.cpp (llama-cpp-python, the GGUF check's reader) from source: both cores, ~5 minutes.
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,plot]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# The optional [scan] extra (sharding.scan_layers). torch_xla 2.9's wheel bundles an older torchax
# that imports flax and can overwrite the pinned one, so the pinned torchax is reinstalled last.
install-scan: $(STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt jax jaxlib
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt --force-reinstall --no-deps torchax
	$(VENV)/bin/python -c "import torchax, jax; print('scan extra ready: jax', jax.__version__)"

demo: $(STAMP)
	$(VENV)/bin/lowmem-tpu sft recipes/tiny_lora_cpu.yaml --overwrite

# Two pytest workers (pytest-xdist), a test module per worker at a time: the suite is mostly
# single-threaded Python and process start-up, so two cores finish it in about half the time.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope

# The fast lane: ruff as above and tests/unit only (no test starts XLA in its process or trains; docs/testing.md).
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope tests/unit

# Every shipped recipe's step traced here and checked against the TPU compiler's verdict for its target
# (a program byte for byte the one in docs/tpu_compile.json keeps its figures; any other is compiled).
tpu-compile-check: $(STAMP)
	$(VENV)/bin/python tools/tpu_compile_recipes.py --check --timeout 1200

lint format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
