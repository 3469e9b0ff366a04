# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

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
	$(BIN)/pytest -q tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
