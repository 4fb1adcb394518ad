# Commands that work on a fresh machine with Python 3.11 and pip:
#   make demo   - train the embedded default (tiny Llama, LoRA, 4 CPU XLA devices); installs the core only
#   make check  - lint, commit subjects and the fast lane (tests/unit: no XLA started, no training)
#   make test   - lint, commit subjects and the whole suite: both lanes, tests/unit and tests/e2e
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt
HASH := $(shell cat constraints.txt pyproject.toml | cksum | cut -d' ' -f1)
# What is installed, per set of pins: the core (what the demo runs) and the development set (the test oracles).
CORE := $(VENV)/.core-$(HASH)
DEV := $(VENV)/.dev-$(HASH)

.PHONY: demo check test lint format install install-dev install-scan hooks tpu-compile-check clean

install: $(CORE)
install-dev: $(DEV)

$(CORE): constraints.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e ".[plot]"
	rm -f $(VENV)/.core-* && touch $@

# [dev]: ruff, pytest and the oracles the tests check against. llama-cpp-python builds llama.cpp from
# source (the GGUF check's reader): both cores, minutes.
$(DEV): $(CORE)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) -e ".[dev,plot]"
	rm -f $(VENV)/.dev-* && touch $@

# The optional [scan] extra (sharding.scan_layers). torch_xla 2.9's wheel bundles an older torchax
# that imports flax and can overwrite the pinned one, so the pinned torchax is reinstalled last.
install-scan: $(DEV)
	$(PIP) jax jaxlib
	$(PIP) --force-reinstall --no-deps torchax
	$(VENV)/bin/python -c "import torchax, jax; print('scan extra ready: jax', jax.__version__)"

demo: $(CORE)
	$(VENV)/bin/lowmem-tpu sft recipes/tiny_lora_cpu.yaml --overwrite

# Two pytest workers (pytest-xdist), a test module per worker at a time: the suite is mostly
# single-threaded Python and process start-up, so two cores finish it in about half the time.
TEST_WORKERS ?= 2
test: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python tools/commit_subjects.py
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope tests/unit tests/e2e

# The fast lane (a bare `pytest` runs it too): ruff, commit subjects, tests/unit (no test starts XLA or trains).
check: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python tools/commit_subjects.py
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope tests/unit

# The commit-msg hook: a subject over 72 characters is refused when it is written.
hooks:
	git config core.hooksPath tools/githooks

# Every shipped recipe's step traced here and checked against the TPU compiler's verdict for its target
# (a program byte for byte the one in docs/tpu_compile.json keeps its figures; any other is compiled).
tpu-compile-check: $(DEV)
	$(VENV)/bin/python tools/tpu_compile_recipes.py --check --timeout 1200

lint format: $(DEV)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
