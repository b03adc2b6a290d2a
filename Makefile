# kvpipe — the two commands of the quick start are `make run` and `make test`.
# Both build .venv from nothing on a fresh machine; nothing installed by hand is assumed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# Re-install when the packaging or a C extension changes.
HASH   := $(shell cat pyproject.toml setup.py kvpipe/backends/file/_fileio.c kvpipe/_digests.c | cksum | cut -d' ' -f1)

.PHONY: run test lint unit bench soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.base-$(HASH): $(BIN)/python
	$(PIP) install --quiet -e .
	rm -f $(VENV)/.base-*; touch $@

$(VENV)/.test-$(HASH): $(BIN)/python
	$(PIP) install --quiet -e '.[test]'
	rm -f $(VENV)/.test-* $(VENV)/.base-*; touch $@ $(VENV)/.base-$(HASH)

# The Mooncake client links libibverbs even for TCP; install it when the system lacks it.
.PHONY: system-deps
system-deps:
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { \
	  echo "installing libibverbs1 (Mooncake's native client needs it)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 >/dev/null; }

## run: the end-to-end offload -> reload demo on the embedded default store
run: $(VENV)/.base-$(HASH)
	$(BIN)/kvpipe demo

## test: lint, type-check and the whole test suite
test: system-deps $(VENV)/.test-$(HASH)
	$(BIN)/ruff check kvpipe tests examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(VENV)/.test-$(HASH)
	$(BIN)/ruff check kvpipe tests examples
	$(BIN)/ruff format --check kvpipe tests

unit: $(VENV)/.test-$(HASH)
	$(BIN)/python -m pytest -q -m "not slow"

## bench: the whole benchmark suite, baselines measured in the same run (under 10 minutes):
## the file store vs raw files, MooncakeStore vs the direct Mooncake client, the memory store
## vs plain numpy, sweeps, scaling, event-loop lag, actor overhead, the FastDeploy adapter
## from 4 threads vs the pipeline on its own loop (integration), and an ASGI server's latency
## while kvpipe and a hand-written offload move blocks (server). Writes
## docs/benchmarks/*.{json,md}, the generated sections of docs/performance.md and
## docs/img/*.png.
bench: system-deps $(VENV)/.base-$(HASH)
	@$(BIN)/python -c 'import mooncake.store' 2>/dev/null || $(PIP) install --quiet -e '.[mooncake]'
	@$(BIN)/python -c 'import matplotlib, uvicorn' 2>/dev/null || $(PIP) install --quiet -e '.[bench]'
	@$(BIN)/python -c 'import paddle' 2>/dev/null || $(PIP) install --quiet -e '.[paddle]'
	mkdir -p docs/benchmarks docs/img
	$(BIN)/kvpipe bench --scenario file --json docs/benchmarks/file.json --markdown docs/benchmarks/file.md
	$(BIN)/kvpipe bench --scenario mooncake --json docs/benchmarks/mooncake.json \
	  --markdown docs/benchmarks/mooncake.md
	$(BIN)/kvpipe bench --scenario memory --scenario sweeps --scenario scaling \
	  --scenario lag --scenario overhead --scenario integration --scenario server \
	  --json docs/benchmarks/suite.json \
	  --markdown docs/benchmarks/suite.md --plot docs/img --doc docs/performance.md

## soak: the fault scenarios over and over (minutes; not part of `make test`): every scenario
## on the memory and the file store for seeds 0-19, three times each, then the partial-put race
## on the file store (seed 2) 50 times. Prints each broken run and fails if any broke.
SOAK_SEEDS ?= $(shell seq 0 19)
KVPIPE     ?= $(BIN)/kvpipe
soak: $(VENV)/.base-$(HASH)
	@out=$$(mktemp); trap 'rm -f "$$out"' EXIT; runs=0; broken=0; \
	soak_run() { \
	  runs=$$((runs + 1)); \
	  if ! $(KVPIPE) --log-level critical faults "$$@" >"$$out" 2>&1; then \
	    broken=$$((broken + 1)); echo "BROKEN: kvpipe faults $$*"; cat "$$out"; \
	  fi; }; \
	for store in memory file; do \
	  for seed in $(SOAK_SEEDS); do \
	    for run in 1 2 3; do soak_run --all --store $$store --seed $$seed; done; \
	    echo "soak: --all --store $$store --seed $$seed x3 done ($$broken broken so far)"; \
	  done; \
	done; \
	for run in $$(seq 50); do soak_run --scenario partial_puts --store file --seed 2; done; \
	echo "soak: $$broken of $$runs runs broke an invariant"; [ "$$broken" -eq 0 ]

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis build
	rm -f kvpipe/backends/file/_fileio.*.so
