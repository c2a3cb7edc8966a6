"""The load generator's pure parts: workload specs, Poisson gaps, percentiles and the summary table."""

from __future__ import annotations

import random
import statistics

import pytest

from llm_client.commands.loadstats import (
    LengthDist, format_table, parse_deadlines, parse_priority_mix, percentile, poisson_gaps, summarize,
)


def test_length_mixture_has_the_weights_and_ranges_asked_for():
    dist = LengthDist.parse("0.8:8-32, 0.2:200-600")
    assert dist.components == ((0.8, 8, 32), (0.2, 200, 600))
    rng = random.Random(1)
    samples = [dist.sample(rng) for _ in range(20_000)]
    assert all(8 <= s <= 32 or 200 <= s <= 600 for s in samples)
    long_share = sum(s >= 200 for s in samples) / len(samples)
    assert 0.18 < long_share < 0.22
    assert abs(statistics.mean(samples) - dist.mean) / dist.mean < 0.03


def test_length_shorthands_and_bad_specs():
    assert LengthDist.parse("16").components == ((1.0, 16, 16),)
    assert LengthDist.parse("8-64").components == ((1.0, 8, 64),)
    assert LengthDist.parse("3:1-2,1:5-5").components == ((0.75, 1, 2), (0.25, 5, 5))
    for bad in ("0-4", "9-3", "0:1-4", "x", "-1:2-3"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_priority_mix_is_normalized_and_checked():
    assert parse_priority_mix("0:0.2,1:0.3,2:0.5", 3) == pytest.approx({0: 0.2, 1: 0.3, 2: 0.5})
    assert parse_priority_mix("2:1, 0:3", 3) == {0: 0.75, 2: 0.25}
    assert parse_priority_mix("0:1,1:0", 3) == {0: 1.0}
    for bad in ("3:1", "0:-1", "0:0", "1"):
        with pytest.raises(ValueError):
            parse_priority_mix(bad, 3)


def test_deadlines_per_priority():
    assert parse_deadlines("none", 3) == {0: None, 1: None, 2: None}
    assert parse_deadlines("30", 2) == {0: 30.0, 1: 30.0}
    assert parse_deadlines("0:5,2:30", 3) == {0: 5.0, 1: None, 2: 30.0}
    with pytest.raises(ValueError):
        parse_deadlines("4:1", 3)


def test_poisson_gaps_have_the_mean_and_spread_of_an_exponential():
    gaps = poisson_gaps(20.0, random.Random(7))
    samples = [next(gaps) for _ in range(20_000)]
    assert statistics.mean(samples) == pytest.approx(0.05, rel=0.03)
    assert statistics.stdev(samples) == pytest.approx(0.05, rel=0.05)  # exponential: stdev = mean
    with pytest.raises(ValueError):
        next(poisson_gaps(0.0, random.Random(0)))


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in range(1, 11)]  # numpy.percentile(1..10, q)
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(list(reversed(values)), 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def record(priority, status, reason, tokens=0, ttft=None, e2e=None):
    return {"priority": priority, "status": status, "reason": reason, "completion_tokens": tokens,
            "ttft_s": ttft, "e2e_s": e2e}


def test_summary_counts_rates_and_latencies_per_priority():
    records = [record(0, "completed", "length", 10, ttft=0.1 * i, e2e=1.0 * i) for i in range(1, 11)]
    records += [record(2, "rejected", "shed"), record(2, "rejected", "shed"), record(2, "rejected", "deadline"),
                record(2, "error", "invalid_request"), record(2, "timeout", "timeout"),
                record(2, "completed", "stop", 4, ttft=0.2, e2e=0.4)]
    table = summarize(records, wall_s=2.0)
    assert list(table) == ["0", "2", "all"]
    p0, p2, total = table["0"], table["2"], table["all"]
    assert (p0["num_sent"], p0["num_completed"], p0["num_rejected"]) == (10, 10, 0)
    assert p0["completed_per_s"] == 5.0 and p0["output_tokens_per_s"] == 50.0
    assert p0["ttft_ms"] == {"p50": 550.0, "p95": 955.0, "p99": 991.0}
    assert p0["e2e_ms"]["p50"] == 5500.0
    assert p2["rejected_by_reason"] == {"shed": 2, "deadline": 1}
    assert p2["errors_by_reason"] == {"invalid_request": 1}
    assert (p2["num_error"], p2["num_timeout"], p2["num_completed"]) == (1, 1, 1)
    assert p2["ttft_ms"] == {"p50": 200.0, "p95": 200.0, "p99": 200.0}  # latencies of completed ones only
    assert total["num_sent"] == 16 and total["num_completed"] == 11
    text = format_table(table)
    assert text.splitlines()[0].split()[:3] == ["prio", "sent", "done"]
    assert "p2: deadline=1, invalid_request=1, shed=2" in text
    assert len(text.splitlines()) == 2 + 3 + 1


def test_summary_of_a_priority_without_completions_has_no_latencies():
    table = summarize([record(1, "rejected", "shed")], wall_s=1.0)
    assert table["1"]["ttft_ms"] == {"p50": None, "p95": None, "p99": None}
    assert "  -/-/-" in format_table(table)
