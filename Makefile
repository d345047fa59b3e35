# Two set-up commands for a fresh machine: `make demo` and `make test` (see README).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean wheel

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first: 2.13.0 is the CPU wheel on disk; anything else pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(VENV)/bin/pip install -q -e '.[test]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raypipe demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -p no:cacheprovider --durations=25 tests

# The wheel cluster.yaml syncs to every node (file_mounts): exactly this checkout's code.
wheel: $(STAMP)
	rm -rf dist
	$(VENV)/bin/pip wheel -q --no-deps --no-build-isolation -w dist .

bench: $(STAMP)
	$(VENV)/bin/raypipe bench encode
	$(VENV)/bin/raypipe bench decode
	$(VENV)/bin/raypipe bench serve

clean:
	rm -rf $(VENV) bench-results dist
