# Two commands a user needs: `make demo` and `make test`. Each bootstraps .venv from a clean checkout.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_VERSION := 26.3
# Extra pip options for the torch step only, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# where the default index would give a CUDA build (docs/development.md).
TORCH_PIP_ARGS ?=

.PHONY: demo test test-kernels lint typecheck bench-smoke flower-example flowertune-example browser lock clean

# Bootstrap (docs/development.md): every package but torch comes from the hashed requirements.lock, without
# resolution; then torch, pinned by version in constraints.txt (its dependencies are already there); then the
# project, built by the locked setuptools; last, a check that the venv holds exactly that set.
$(STAMP): pyproject.toml requirements.lock constraints.txt scripts/check_install.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	$(BIN)/pip install -q --require-hashes --no-deps -r requirements.lock
	$(BIN)/pip install -q -c constraints.txt $(TORCH_PIP_ARGS) torch
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python scripts/check_install.py
	touch $(STAMP)

# Regenerate requirements.lock (keeps existing pins): `make lock`, `make lock LOCK_ARGS="-P transformers"`,
# `make lock LOCK_ARGS=--upgrade`; then `make clean test`.
lock:
	PYTHON=$(PYTHON) bash scripts/lock.sh $(LOCK_ARGS)

demo: $(STAMP)
	$(BIN)/gradleak demo

# The suite on up to 4 cores (pytest-xdist; tests that start Ray or a SuperLink share one worker, tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: $(STAMP)
	-bash scripts/setup_wordnet.sh $(BIN)/python
	$(PYTEST)

# The fast suite again under other CPU kernel sets than the native one (torch's ATEN_CPU_CAPABILITY changes
# the rounding): a test that passes natively but not here asserts a rounding margin, not correctness.
# A capability above what the CPU has runs the best one it has. CI runs `make test test-kernels`.
# A kernel set equal to the CPU's native one repeats `make test` exactly, so it is skipped (on an AVX2 machine
# only `default` runs again).
KERNELS ?= default avx2
test-kernels: $(STAMP)
	-bash scripts/setup_wordnet.sh $(BIN)/python
	native=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in $(KERNELS); do \
		if [ "$$cap" = "$$native" ]; then echo "== ATEN_CPU_CAPABILITY=$$cap is this CPU's native set: make test ran it"; continue; fi; \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(PYTEST) -p no:cacheprovider || exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/mypy tests/test_registry_types.py
	$(BIN)/lint-imports

# Debian's chromium for the reports' browser tests (tests/experiments/test_report.py and the Flower quickstart's
# test skip without it);
# a system package, as a pip package that downloads a browser cannot work here.
browser:
	command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

# The Flower quickstart under Flower's own CLI (examples/flower/README.md): 4 simulated SuperNodes on Ray, 3 rounds,
# gradleak's audit in $FLWR_HOME/audit.sqlite (default ~/.flwr), then its report (report.html, with a verdict a line).
flower-example: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
		$(BIN)/flwr run examples/flower --stream --federation-config "num-supernodes=4"
	$(BIN)/gradleak report "$${FLWR_HOME:-$$HOME/.flwr}/audit.sqlite" latest \
		--figures "$${FLWR_HOME:-$$HOME/.flwr}/audit-figures" --out report.html

# The FlowerTune-shaped LLM app (examples/flowertune/README.md): SmolLM2-135M + LoRA, adapters only on the wire,
# 4 SuperNodes, 2 rounds, gradleak's text audit; then its report (flowertune-report.html).
flowertune-example: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
		$(BIN)/flwr run examples/flowertune --stream --federation-config "num-supernodes=4"
	$(BIN)/gradleak report "$${FLWR_HOME:-$$HOME/.flwr}/audit.sqlite" latest --out flowertune-report.html

bench-smoke: $(STAMP)
	$(BIN)/python benchmarks/fl_overhead.py --scale smoke

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
