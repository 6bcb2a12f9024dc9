# vqserve developer verbs. `make test` and `make serve` work on a fresh machine:
# the first run creates .venv, installs the pinned CPU torch and the project.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.installed
PORT   ?= 50051
METRICS_PORT ?= 50052
# `make serve HOST=127.0.0.1 MODEL=runs/mine PORT=50061 SERVE_ARGS="--max-pixels 4096x3072"`.
# HOST and MODEL are plain `=` so that shell variables of the same common names (zsh sets
# HOST to the machine name) do not leak in; command-line assignments still override them.
HOST   = [::]
MODEL  = default
SERVE_ARGS ?=
PYTEST_ARGS ?=
# `make test` runs the suite in this pytest process; TEST_WORKERS=2 spreads it over two
# pytest-xdist workers (on the 2-core machine not faster: the suite is CPU-bound there, and two
# workers' torch threads oversubscribe the cores)
TEST_WORKERS ?= 0
BENCH_OUT ?= /tmp/vqserve-bench
# `make fuzz FUZZ_EXAMPLES=200` (examples per fuzz test; `make test` runs 25), counts -> FUZZ_REPORT;
# FUZZ_FRONTENDS=2 fuzzes the server split into 2 front-end processes before one executor
FUZZ_EXAMPLES ?= 2000
FUZZ_FRONTENDS ?= 0
FUZZ_REPORT ?= /tmp/vqserve-fuzz.json
# `make soak SOAK_ARGS="--duration 1 --clients 16"`; the model is MODEL
SOAK_ARGS ?=
SOAK_FRONTENDS ?= 2
SEED ?=

IMAGE  ?= vqserve:latest

.PHONY: help venv test test-reverse test-random lint importlint pytest serve protos bench bench-quick bench-quantizers bench-tokenize bench-gpu fuzz soak soak-split docker docker-cpu clean

help:
	@echo "make test    - create .venv (CPU torch), lint, import contracts, run the test suite"
	@echo "make test-reverse / make test-random SEED=N - the suite in another order (one process)"
	@echo "make serve   - serve MODEL=$(MODEL) on $(HOST):$(PORT) (metrics :$(METRICS_PORT));"
	@echo "               override with make serve HOST= MODEL= PORT= METRICS_PORT= SERVE_ARGS="
	@echo "make protos  - regenerate the gRPC stubs from protos/"
	@echo "make bench   - every serving benchmark, TorchServe included -> docs/BENCHMARKS.md (~15 min)"
	@echo "make bench-quick    - the same on a tiny model in about a minute, into BENCH_OUT=$(BENCH_OUT)"
	@echo "make bench-quantizers - FSQ/LFQ vs vector-quantize-pytorch, fp32-island cost"
	@echo "make bench-tokenize - vqserve tokenize end-to-end vs the raw runtime (docs/TOKENIZE.md)"
	@echo "make bench-gpu - on a CUDA machine: every GPU figure in one run (~4 min) -> BENCH_OUT/gpu.json"
	@echo "make fuzz    - malformed requests on every RPC of a real server (~5 min); counts by status code"
	@echo "make soak    - 64 clients for 5 minutes on MODEL=$(MODEL); one PASS/FAIL line (SOAK_ARGS=)"
	@echo "make soak-split - the same split into SOAK_FRONTENDS=$(SOAK_FRONTENDS) front-ends + executor on synthetic:200;"
	@echo "               an hour: make soak-split SOAK_ARGS=\"--duration 60\""
	@echo "make docker  - build the GPU image (needs a Docker engine); make docker-cpu for the CPU one"
	@echo "make clean   - remove .venv and caches"
	@echo "make data    - fetch the pinned Debian package photographs for training/selection/test (~165 MB)"

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# the training / selection / test photographs from pinned Debian packages (docs/TRAINING.md);
# VQSERVE_DATA_DIR overrides the cache (~/.cache/vqserve/data)
.PHONY: data
data: $(STAMP)
	$(BIN)/python -m vqserve.training.datasets fetch

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/hadolint Dockerfile

importlint: $(STAMP)
	VENV=$(VENV) scripts/lint_imports.sh

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# the same suite in reverse, or shuffled (SEED=: that order again): a test that passes only
# where it lands in the order is a bug (tests/plugins/process_state.py)
test-reverse: $(STAMP)
	VQSERVE_TEST_ORDER=reverse $(BIN)/python -m pytest -q -p no:xdist $(PYTEST_ARGS)

test-random: $(STAMP)
	VQSERVE_TEST_ORDER=random:$(SEED) $(BIN)/python -m pytest -q -p no:xdist $(PYTEST_ARGS)

test: lint importlint pytest

serve: $(STAMP)
	$(BIN)/vqserve serve --model '$(MODEL)' --host '$(HOST)' --port '$(PORT)' \
		--metrics-port '$(METRICS_PORT)' $(SERVE_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

# The full run writes docs/BENCHMARKS.md, docs/bench/*.png and docs/bench/benchmarks.json.
bench: $(STAMP)
	$(BIN)/vqserve bench all --out docs

bench-quick: $(STAMP)
	$(BIN)/vqserve bench all --quick --out '$(BENCH_OUT)'

bench-quantizers: $(STAMP)
	$(BIN)/vqserve bench quantizers

bench-tokenize: $(STAMP)
	$(BIN)/vqserve bench tokenize

# a GPU user's own environment (README "GPU install": CUDA torch), not the CPU-pinned .venv
bench-gpu:
	mkdir -p '$(BENCH_OUT)'
	vqserve bench gpu --json '$(BENCH_OUT)/gpu.json'

fuzz: $(STAMP)
	VQSERVE_FUZZ_EXAMPLES='$(FUZZ_EXAMPLES)' VQSERVE_FUZZ_FRONTENDS='$(FUZZ_FRONTENDS)' FUZZ_REPORT='$(FUZZ_REPORT)' \
		$(BIN)/python -m pytest -q -s tests/integration/fuzz/

soak: $(STAMP)
	$(BIN)/python -m vqserve.bench.soak --model '$(MODEL)' $(SOAK_ARGS)

# the GPU node's layout on the stand-in accelerator: SOAK_FRONTENDS front-ends, one executor,
# 64 clients, 5 minutes; an hour: make soak-split SOAK_ARGS="--duration 60"
soak-split: $(STAMP)
	$(BIN)/python -m vqserve.bench.soak --model synthetic:200 --frontends '$(SOAK_FRONTENDS)' --clients 64 $(SOAK_ARGS)

docker:
	docker build -t $(IMAGE) .

docker-cpu:
	docker build -t $(IMAGE)-cpu --build-arg VARIANT=cpu .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
