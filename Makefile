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

.PHONY: install test lint typecheck pytest demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml $(VLLM_REQUIREMENTS)
	@echo "make install: installing torch, tiering, the dev tools and vLLM (tests only, --no-deps) into $(VENV) (a few minutes the first time)"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps -r $(VLLM_REQUIREMENTS)
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check tiering tests benchmarks
	$(VENV)/bin/ruff format --check tiering tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

# REQUIRE_VLLM_TESTS: the adapter tests fail (not skip) if vLLM is missing from the venv.
pytest: install
	REQUIRE_VLLM_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test: lint typecheck pytest

demo: install
	$(VENV)/bin/tiering replay --config examples/tiering.yaml --fresh

bench: install
	$(PY) benchmarks/run_all.py --out docs/benchmarks.md

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
