"""Percentiles and summaries used by the benchmark report, against hand-computed values."""

import math

import pytest

from benchmarks.lib.run_result import RequestRecord, RunResult, compute_metrics
from benchmarks.lib.stats import latency_summary, median_min_max, percentile, ratio


def test_percentile_interpolates_like_numpy_linear():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)
    assert percentile([7.0], 99) == 7.0


def test_percentile_edge_cases():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_summary_and_median_min_max():
    s = latency_summary([0.1, 0.2, 0.3, 0.4])
    assert s["n"] == 4 and s["p50"] == pytest.approx(0.25) and s["mean"] == pytest.approx(0.25) and s["max"] == 0.4
    assert latency_summary([])["n"] == 0
    m = median_min_max([3.0, 1.0, float("nan"), 2.0])
    assert m == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert median_min_max([])["n"] == 0
    assert ratio(6.0, 3.0) == 2.0 and math.isnan(ratio(1.0, 0.0))


def test_compute_metrics_per_kind():
    records = [
        RequestRecord("a", "short", 0, 0.0, 10, 4, first_token_s=0.5, finish_s=1.0),
        RequestRecord("b", "short", 1, 1.0, 10, 4, first_token_s=1.5, finish_s=3.0),
        RequestRecord("c", "long", 2, 0.0, 50, 8, first_token_s=2.0, finish_s=4.0),
        RequestRecord("d", "long", 2, 0.0, 50, 0, error="prompt_too_long"),
    ]
    m = compute_metrics(RunResult("x", 2.0, records, wall_s=4.0, kv_utilisation=[0.5, 1.0]))
    assert m["num_completed"] == 3 and m["num_errors"] == 1
    assert m["output_tokens_per_s"] == pytest.approx(16 / 4.0)
    assert m["requests_per_s"] == pytest.approx(3 / 4.0)
    assert m["kv_utilisation_mean"] == pytest.approx(0.75)
    assert m["latency"]["short"]["ttft"]["p50"] == pytest.approx(0.5)
    assert m["latency"]["short"]["e2e"]["max"] == pytest.approx(2.0)
    assert m["latency"]["long"]["e2e"]["n"] == 1
    assert m["latency"]["all"]["e2e"]["n"] == 3
