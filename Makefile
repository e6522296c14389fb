# Two entry points, each doing all set-up on a fresh machine:
#   make demo   build the example archive, start TorchServe, register, score the example requests
#   make test   run the whole test suite
#   make bench SCENARIO=criteo   run a benchmark scenario (smoke, criteo, speed, reliability, freshness, ...); results in benchmarks/results/
#                                (SCENARIO=plan DATA="FILE ...": the planner on a click log: Criteo TSV/CSV files, or libfm files)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

SCENARIO ?= smoke

.PHONY: setup java wrk prometheus plugin demo test bench clean

setup: java $(STAMP) plugin

# The TorchServe plugin jar, rebuilt when its Java sources or TorchServe change.
plugin: $(STAMP)
	@$(BIN)/python -c "from archive_tools.plugin import plugin_dir; print('plugin:', plugin_dir())"

# TorchServe's frontend is Java 17 or newer, and our plugin (archive_tools/plugin) is compiled
# from source with javac: a JDK 17 is installed with apt when we are root, else explained.
java:
	@v=$$(java -version 2>&1 | awk -F'"' '/version/ {print $$2}' | cut -d. -f1); \
	if [ -z "$$v" ] || [ "$$v" -lt 17 ] || ! command -v javac >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "JDK 17+ not found (java '$${v:-none}', javac $$(command -v javac || echo none)): installing openjdk-17-jdk-headless"; \
	    apt-get update -qq && apt-get install -y -qq openjdk-17-jdk-headless; \
	  else \
	    echo "TorchServe and its plugin need a JDK 17 or newer (java: $${v:-none}, javac: $$(command -v javac || echo none))."; \
	    echo "Install it, e.g.: sudo apt-get install openjdk-17-jdk-headless"; exit 1; \
	  fi; \
	fi

# The benchmarks' closed-loop client (benchmarks/wrk.py): a Python client saturates below
# TorchServe's own floor on a small machine. The tests run the benchmarks' smoke scenarios, so
# `make test` and `make bench` need it (`make demo` does not). Installed with apt when we are
# root, else explained.
wrk:
	@if ! command -v wrk >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "wrk not found: installing it (the benchmarks' load generator)"; \
	    apt-get update -qq && apt-get install -y -qq wrk; \
	  else \
	    echo "The tests and benchmarks need wrk, the benchmarks' load generator (not found)."; \
	    echo "Install it, e.g.: sudo apt-get install wrk"; exit 1; \
	  fi; \
	fi

# Prometheus itself: a test scrapes the asgi engine's /metrics with it (tests/integration/test_asgi_metrics.py).
# Installed with apt when we are root, else explained.
prometheus:
	@if ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "prometheus not found: installing it (a test scrapes the asgi engine with it)"; \
	    apt-get update -qq && apt-get install -y -qq prometheus; \
	  else \
	    echo "The tests need prometheus, which scrapes the asgi engine's metrics in one of them (not found)."; \
	    echo "Install it, e.g.: sudo apt-get install prometheus"; exit 1; \
	  fi; \
	fi

# torch is pinned and installed first so nothing resolves a CUDA build; torchrec goes in with
# --no-deps because its metadata asks for the CUDA fbgemm-gpu (we use fbgemm-gpu-cpu).
$(STAMP): pyproject.toml examples/din/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	$(BIN)/pip install --quiet --no-deps -e examples/din  # the DIN example: a user's own architecture package
	$(BIN)/pip install --quiet --no-deps kserve==0.21.0  # its SDK's models check examples/kserve (tests/examples); the rest of it would take protobuf<7, psutil<6
	$(BIN)/torchrec-serve --help > /dev/null
	$(BIN)/python -c "from handlers.runtime.remote.grpc_stubs import messages; messages()"  # gRPC stubs compile
	$(BIN)/python -c "from handlers.runtime.wire.v2_grpc import messages; messages()"  # and the Open Inference Protocol's
	$(BIN)/python -c "import torch, torchrec, fbgemm_gpu, ts; print('torch', torch.__version__, 'torchrec', torchrec.__version__)"
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

# Two processes, a test file each at a time (its servers and archives stay its own): most tests
# wait on servers and loads, so two share this machine's two cores well (three took as long: 11:28
# against 11:52). Files go in the order tests/conftest.py gives (the slowest first), and the ten
# slowest tests are listed.
test: setup wrk prometheus
	$(BIN)/python -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --durations=10 tests

bench: setup wrk
	$(BIN)/torchrec-serve bench $(SCENARIO) $(if $(DATA),--data $(DATA))

clean:
	rm -rf $(VENV) model_store/*.mar
