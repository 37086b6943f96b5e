# tritonlm: `make serve` and `make test` are the two commands; both set up what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.tritonlm-setup
KERNELS_STAMP := $(VENV)/.tritonlm-kernels
KERNEL_SOURCES := $(wildcard tritonlm/engine/kernels/*.cpp tritonlm/engine/kernels/*.h)
MODEL ?= smollm2-135m
DRAFT ?=
NAME ?=
REPO ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
# `make serve HOST=0.0.0.0` listens on every interface; only a command-line HOST counts
# (some shells export HOST as the machine's name).
ifneq ($(origin HOST),command line)
HOST := 127.0.0.1
endif
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit bench doctor clean demo-scale bench-peer bench-engine bench-guided

setup: $(STAMP) $(KERNELS_STAMP)

# Re-runs only when the dependency list changes; a second `make setup` is a no-op.
$(STAMP): pyproject.toml scripts/setup_system.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
		|| $(PIP) install --quiet --disable-pip-version-check torch==2.13.0
	$(PIP) install --quiet --disable-pip-version-check -e ".[test]"
	bash scripts/setup_system.sh $(PY)
	$(VENV)/bin/tritonlm setup-backend
	@touch $(STAMP)

# the C++ kernels, compiled once per x86-64 ISA level (the loader picks the best one the CPU
# runs, so serving needs no compiler); again when their sources change. A level that fails
# to build is retried by the next `make setup`; meanwhile the loader compiles at first use.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_SOURCES)
	if $(PY) -m tritonlm.engine.kernels --prebuild; then touch $@; fi

serve: setup
	$(VENV)/bin/tritonlm serve-default --model $(MODEL) $(if $(DRAFT),--draft $(DRAFT)) $(if $(NAME),--name $(NAME)) \
		--repo $(REPO) --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT)

# every test: unit tests (tests/unit, no server) and real-server tests (tests/integration)
test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# the unit tests alone, for the edit-test loop
test-unit: setup
	$(VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python perf/run_all.py

# tritonlm vs llama.cpp's llama-server, same model and clients (builds llama.cpp into .cache/
# the first time: minutes); BENCH_PEER_ARGS=--quick for a smoke run
bench-peer: setup
	$(VENV)/bin/python perf/bench_peer.py $(BENCH_PEER_ARGS)

# the in-process engine's own cost per generated token (tiny model), split by phase;
# BENCH_ENGINE_ARGS=--rows 1,256 for fewer row counts
bench-engine: setup
	$(VENV)/bin/python perf/bench_engine_overhead.py $(BENCH_ENGINE_ARGS)

# guided decoding (a JSON schema) vs unconstrained, in-process engine (SmolLM2-135M), 1/8/32 streams;
# BENCH_GUIDED_ARGS=--model tiny-gpt2 for the tiny model
bench-guided: setup
	$(VENV)/bin/python perf/bench_guided.py $(BENCH_GUIDED_ARGS)

# two tritonlm serve replicas behind nginx, one restarted under load (deploy/README.md)
demo-scale: setup
	$(VENV)/bin/python perf/demo_scale.py

doctor: setup
	$(VENV)/bin/tritonlm doctor

clean:
	rm -rf build results .pytest_cache
