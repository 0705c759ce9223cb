# The two quickstart commands: `make demo` and `make test`. Both create ./.venv and install into it.
# torch is installed first and pinned so a CPU machine gets the CPU build; on a GPU machine
# override it, e.g. `make test TORCH_SPEC="torch>=2.13"`.
# `make test-min` tests the lowest supported versions (constraints/min.txt) in ./.venv-min; CI runs both.
# `make install` pins the newest tested set (constraints/newest.txt, the versions README's table states);
# `make install NEWEST=` installs the latest releases instead, to test them before raising those pins.
PYTHON ?= python3
VENV ?= .venv
MIN_VENV ?= .venv-min
TORCH_SPEC ?= torch==2.13.0
NEWEST ?= constraints/newest.txt
PY := $(VENV)/bin/python
MIN_PY := $(MIN_VENV)/bin/python
STAMP := $(VENV)/.hf_dist-installed
MIN_STAMP := $(MIN_VENV)/.hf_dist-installed

# uv, when on PATH (or UV=/path/to/uv), installs much faster than pip (the lowest set: 42 s vs 5 min 55 s,
# docs/testing.md); pip otherwise. uv does not read pip's config, so pip's find-links (where a machine keeps
# its CPU torch wheel) are passed on.
UV ?= $(shell command -v uv 2>/dev/null)
PIP_LINKS := $(or $(PIP_FIND_LINKS),$(if $(UV),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)))
UV_LINKS := $(if $(PIP_LINKS),--find-links $(PIP_LINKS))
mkvenv = $(if $(UV),$(UV) venv -q --seed --allow-existing --python $(PYTHON) $(1),$(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install -q --upgrade pip)
pip_install = $(if $(UV),$(UV) pip install -q $(UV_LINKS) --python $(1)/bin/python,$(1)/bin/python -m pip install -q)
# Each install of a venv compiles the modules it installed to bytecode, as pip does by default and uv does not (uv's
# --compile-bytecode covers the packages of its own command only, so the torch step needs it too): where
# PYTHONDONTWRITEBYTECODE is set (many containers), Python never writes a .pyc itself, so without this every process
# compiles torch, sympy, transformers and DeepSpeed from source again (importing the Trainer: 16.6 s of CPU with torch
# and its dependencies uncompiled, 10.0 s compiled; the tests start hundreds of processes). hf_dist's own modules too
# (an editable install is not compiled).
compile_all = $(if $(UV),--compile-bytecode)
compile_repo = $(1)/bin/python -m compileall -q -j 0 hf_dist tests recipes

# one 2-rank Trainer launch per strategy family (DDP, FSDP2, DeepSpeed ZeRO) against the 1-process baseline, and the
# same families resumed under attach: the loading allowlist (numpy's RNG state, DeepSpeed's types) on these versions
MIN_LAUNCHES := -k "baseline or ddp or fsdp_full_shard or (zero3 and not offload)"

# ZeRO-Infinity (NVMe offload) needs DeepSpeed's async_io op, which builds against libaio: installed here with apt
# where apt-get runs as root (Debian/Ubuntu); elsewhere the NVMe tests skip and say what to install.
AIO_BUILD := from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); b.is_compatible(False) and b.load(verbose=False)
# torch waits forever on the build lock of a killed JIT build (an interrupted make test): such locks go first
CLEAR_LOCKS := from hf_dist.testing import clear_stale_build_locks; clear_stale_build_locks()

.PHONY: install install-min libaio aio-op demo test test-min lint bench

$(STAMP): pyproject.toml $(NEWEST)
	$(call mkvenv,$(VENV))
	$(call pip_install,$(VENV)) $(compile_all) "$(TORCH_SPEC)"
	$(call pip_install,$(VENV)) $(compile_all) $(if $(NEWEST),-c $(NEWEST)) -e ".[dev,trl]"
	$(call compile_repo,$(VENV))
	touch $(STAMP)

$(MIN_STAMP): pyproject.toml constraints/min.txt
	$(call mkvenv,$(MIN_VENV))
	$(call pip_install,$(MIN_VENV)) $(compile_all) -c constraints/min.txt torch
	$(call pip_install,$(MIN_VENV)) $(compile_all) -c constraints/min.txt -e ".[dev]"
	$(call compile_repo,$(MIN_VENV))
	touch $(MIN_STAMP)

install: $(STAMP)

install-min: $(MIN_STAMP)

demo: install
	$(PY) -m hf_dist.demo

libaio:
	@if [ -e /usr/include/libaio.h ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "[make] installing libaio-dev for DeepSpeed's async_io op (NVMe offload)"; \
		apt-get install -y -q libaio-dev >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libaio-dev >/dev/null 2>&1) \
		|| echo "[make] could not install libaio-dev: the NVMe offload tests will skip"; \
	else \
		echo "[make] libaio is missing: the NVMe offload tests will skip; as root, install libaio-dev (apt) or libaio-devel (dnf/yum)"; \
	fi

# The async_io op JIT-builds once (about 3.5 min on 2 cores) into torch's extension cache, which later runs reuse
# (a second call only loads it). Built before the tests rather than beside them: the straggler test times its ranks.
# .ci/run starts this target in the background during `make test-min`, so CI does not wait for it.
aio-op: install libaio
	@$(PY) -c "$(CLEAR_LOCKS)"
	@$(PY) -c "$(AIO_BUILD)"

test: install libaio aio-op
	$(PY) -m pytest -q --durations=30 tests

# the lowest supported set: unit tests, then one launch per strategy family; DeepSpeed's JIT-built ops of
# another version get their own cache so the two venvs do not rebuild each other's
test-min: install-min
	$(MIN_PY) -m pytest -q tests/unit
	TORCH_EXTENSIONS_DIR=$(abspath $(MIN_VENV))/torch_extensions $(MIN_PY) -c "$(CLEAR_LOCKS)"
	TORCH_EXTENSIONS_DIR=$(abspath $(MIN_VENV))/torch_extensions \
		$(MIN_PY) -m pytest -q tests/distributed/test_strategies.py tests/distributed/test_planted_resume.py $(MIN_LAUNCHES)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
