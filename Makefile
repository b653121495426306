# Set up and run everything from a fresh clone. The virtualenv lives in .venv.
PYTHON ?= python3
VENV ?= .venv
# This machine has a local CPU wheel of torch 2.13.0; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The real vLLM for the adapter tests: --no-deps (it pins another torch), plus the packages its
# offloading modules import, pinned in one file. pip caches the 336 MB wheel.
VLLM_REQUIREMENTS := requirements/vllm-test.txt
# The real SGLang and LMCache for the engine-adapter tests, the same way (tests/engines).
ENGINES_REQUIREMENTS := requirements/engines-test.txt

.PHONY: install test lint typecheck pytest demo bench clean gpu-wheels gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml $(VLLM_REQUIREMENTS) $(ENGINES_REQUIREMENTS)
	@echo "make install: installing torch, tiering, the dev tools vLLM, SGLang and LMCache (tests only, --no-deps) into $(VENV) (a few minutes the first time)"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps -r $(VLLM_REQUIREMENTS)
	$(PY) -m pip install -q --no-deps -r $(ENGINES_REQUIREMENTS)
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check tiering tests benchmarks
	$(VENV)/bin/ruff format --check tiering tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

# REQUIRE_VLLM_TESTS / REQUIRE_ENGINE_TESTS: the adapter tests fail (not skip) if vLLM / SGLang or
# LMCache is missing from the venv.
# PYTEST_WORKERS: pytest-xdist processes, each a whole test file at a time (a file's fixtures and
# servers stay in one process): the CPUs this process may use, at most 4, as each imports torch
# and vLLM.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1); print(min(4, len(cpus)))')
pytest: install
	REQUIRE_VLLM_TESTS=1 REQUIRE_ENGINE_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider \
		-n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck pytest

demo: install
	$(VENV)/bin/tiering replay --config examples/tiering.yaml --fresh

bench: install
	$(PY) benchmarks/run_all.py --out docs/benchmarks.md

# The GPU proof (benchmarks/gpu_check.py). A GPU machine here has CUDA torch, Triton and
# transformers but no package registry: `make gpu-wheels` (where pip works) fills .gpu-wheels/
# for its Python 3.12, the folder travels with the tree, and `make gpu-check` (there, with the
# image's own python3) installs them with --no-index and writes its results into $$OUT.
# GPU_CHECK_DRY_RUN=1 runs the same steps on CPU with tiny sizes (make test does).
GPU_PYTHON ?= python3
GPU_WHEELS := .gpu-wheels
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) --platform any \
		-d $(GPU_WHEELS) -r requirements/gpu-wheels.txt
	@du -sh $(GPU_WHEELS)

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

# The demo's tiers go first: `tiering wipe` deletes only the files tiering created there (an
# operator's file in a tier directory stays), then the folders it left empty.
DEMO_CONFIG := examples/tiering.yaml
DEMO_DATA := examples/demo-data

clean:
	@if [ -x $(VENV)/bin/tiering ]; then \
		$(VENV)/bin/tiering wipe --config $(DEMO_CONFIG) || exit 1; \
		rmdir $(DEMO_DATA) 2>/dev/null || true; \
	elif [ -d $(DEMO_DATA) ]; then \
		echo "$(DEMO_DATA) kept: run 'make install' first, then 'make clean' (tiering wipe deletes it)"; \
	fi
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
