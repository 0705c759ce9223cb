# The two quickstart commands: `make demo` and `make test`. Both create ./.venv and install into it.
# torch is installed first and pinned so a CPU machine gets the CPU build; on a GPU machine
# override it, e.g. `make test TORCH_SPEC="torch>=2.6"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_dist-installed

.PHONY: install demo test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m hf_dist.demo

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
