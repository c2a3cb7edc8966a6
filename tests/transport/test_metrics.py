"""Metrics: vLLM-style names, one registry per worker, served over HTTP."""

import socket
import urllib.request

from worker.transport.metrics import WorkerMetrics


def test_two_workers_keep_separate_registries_and_names_follow_vllm():
    a, b = WorkerMetrics.create(), WorkerMetrics.create()
    a.requests_rejected.labels(reason="shed").inc(3)
    a.time_to_first_token.observe(0.05)
    a.consumer_lag.labels(priority="2").set(40)
    text = a.exposition()
    assert 'llm_worker:requests_rejected_total{reason="shed"} 3.0' in text
    assert "llm_worker:time_to_first_token_seconds_count 1.0" in text
    assert 'llm_worker:consumer_lag{priority="2"} 40.0' in text
    assert 'reason="shed"' not in b.exposition()


def test_http_endpoint_serves_the_registry():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = WorkerMetrics.create()
    metrics.num_requests_running.set(7)
    server = metrics.serve(port, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert "llm_worker:num_requests_running 7.0" in body


def test_histogram_buckets_are_cumulative_with_le_semantics():
    metrics = WorkerMetrics.create()
    for value in (0.001, 0.0011, 0.3, 1000.0):
        metrics.e2e_request_latency.observe(value)
    text = metrics.exposition()
    name = "llm_worker:e2e_request_latency_seconds"
    assert f'{name}_bucket{{le="0.001"}} 1.0' in text  # an observation equal to a bound falls in it
    assert f'{name}_bucket{{le="0.005"}} 2.0' in text
    assert f'{name}_bucket{{le="0.5"}} 3.0' in text
    assert f'{name}_bucket{{le="+Inf"}} 4.0' in text
    assert f"{name}_count 4.0" in text and f"{name}_sum 1000.3021" in text
