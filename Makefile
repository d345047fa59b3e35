# Two set-up commands for a fresh machine: `make demo` and `make test` (see README).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test test-autoscaling test-extended install bench clean wheel gpu-wheels

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
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -p no:cacheprovider --durations=25 -m "not autoscaling and not extended" tests

# The fake multi-node autoscaling cycles and their fake cluster (~5.5 min on 2 cores): run them when the cluster benches, the fake
# cluster or the Serve/batch scaling paths change. Kept out of `make test` to hold CI under 45 minutes.
test-autoscaling: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -p no:cacheprovider -m autoscaling tests

# Checks `make test` already runs on other families or variants, repeated on more (~3 min on 2 cores): run them
# when a family's tower, its Serve path or a quantized/expert split changes. Kept out of `make test` to hold CI
# under 45 minutes.
test-extended: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -p no:cacheprovider -m extended tests

# The wheel cluster.yaml syncs to every node (file_mounts): exactly this checkout's code.
wheel: $(STAMP)
	rm -rf dist
	$(VENV)/bin/pip wheel -q --no-deps --no-build-isolation -w dist .

# The wheels the lent GPU machine lacks for the engine and towers (docs/gpu.md): it has Python 3.12, torch,
# transformers 5.17, tokenizers, safetensors, huggingface_hub, numpy, pillow, pytest, but no network. They
# travel in an ignored folder of the working tree (under 60 MiB: with the tree, at most 64 MiB travel).
# transformers 5.23 needs huggingface_hub >= 1.31 (5.17 needs only >= 1.5, < 2): the newest 1.x goes along.
# Not torch (the machine's own 2.11 runs transformers 5.23, which needs >= 2.6), not Ray (79 MB; not needed).
GPU_WHEELS_DIR ?= gpu-wheels
GPU_WHEELS := transformers==5.23.0 huggingface_hub==1.33.0 llguidance==1.9.1 av==18.1.0 peft==0.21.2
GPU_PLATFORMS := $(foreach p,manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)
GPU_WHEELS_MAX_BYTES := 62914560

gpu-wheels:
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS_DIR) $(GPU_WHEELS) 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@ls -l $(GPU_WHEELS_DIR)/*.whl | awk '{printf "%6.1f MiB  %s\n", $$5 / 1048576, $$9}'
	@total=$$(cat $(GPU_WHEELS_DIR)/*.whl | wc -c); printf "%6.1f MiB  in all\n" $$(echo "$$total / 1048576" | bc -l); \
		test $$total -le $(GPU_WHEELS_MAX_BYTES) || { echo "over 60 MiB: they would not travel"; exit 1; }
	@echo "On the GPU machine (carry $(GPU_WHEELS_DIR)), from the repository root:"
	@echo "  python3 -m pip install -q --no-deps --no-index --target .gpu-site $(GPU_WHEELS_DIR)/*.whl && PYTHONPATH=\$$PWD/.gpu-site:\$$PWD HF_HUB_OFFLINE=1 python3 -m raypipe.gpucheck --out \$$OUT/gpu-check.json"

bench: $(STAMP)
	$(VENV)/bin/raypipe bench encode
	$(VENV)/bin/raypipe bench decode
	$(VENV)/bin/raypipe bench serve

clean:
	rm -rf $(VENV) bench-results dist $(GPU_WHEELS_DIR) .gpu-site
