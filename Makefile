# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-min lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstall only when the project metadata changes; the CPU torch 2.13.0 build is used when no torch is present.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/suite env
	$(BIN)/suite demo

test: install
	$(BIN)/pytest -q --durations=25 tests

# The same tests on the lowest versions pyproject.toml allows (.ci/lowest-versions.txt), in a venv of their own.
MIN_VENV := .venv-min
$(MIN_VENV)/.installed: pyproject.toml .ci/lowest-versions.txt
	$(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install --quiet --upgrade pip
	$(MIN_VENV)/bin/pip install --quiet torch==2.13.0
	$(MIN_VENV)/bin/pip install --quiet -e ".[test]" -c .ci/lowest-versions.txt
	touch $@

test-min: $(MIN_VENV)/.installed
	$(MIN_VENV)/bin/pytest -q --durations=25 tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(MIN_VENV)

# Wheels for a lent GPU machine, which reaches no package index and lacks these (scripts/gpu_proof.sh installs
# them; docs/benchmarks.md, "GPU proof: how to run"). Pure Python: one wheel each, any platform.
GPU_WHEELS := diffusers==0.42.1 importlib-metadata==10.2.0 tensorboardX==2.6.5
.PHONY: gpu-deps
gpu-deps:
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)
	du -sh .whl
