"""The benchmark trace generator: deterministic by seed, the configured shape, JSON round trip."""

import math
import statistics

import pytest

from benchmarks.lib.trace import PROFILES, Trace, TraceConfig, generate_trace, max_request_len


def test_same_seed_same_trace_and_other_seed_differs():
    config = TraceConfig(rate=4.0, num_requests=50, seed=7)
    assert generate_trace(config).to_json() == generate_trace(config).to_json()
    other = generate_trace(TraceConfig(rate=4.0, num_requests=50, seed=8))
    assert other.to_json() != generate_trace(config).to_json()


def test_poisson_arrivals_sorted_with_mean_gap_one_over_rate():
    trace = generate_trace(TraceConfig(rate=5.0, num_requests=4000, seed=1))
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.1)


@pytest.mark.parametrize("rate", [0.0, math.inf])
def test_offline_trace_arrives_at_once(rate):
    trace = generate_trace(TraceConfig(rate=rate, num_requests=10))
    assert all(r.arrival_s == 0.0 for r in trace.requests)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_lengths_priorities_and_tokens_follow_the_config(profile):
    config = TraceConfig(rate=2.0, num_requests=1500, profile=profile, seed=3, min_token_id=17, vocab_size=1000)
    trace = generate_trace(config)
    classes = {c.name: c for c in PROFILES[profile]}
    for r in trace.requests:
        c = classes[r.kind]
        assert c.prompt_len[0] <= r.num_prompt_tokens <= c.prompt_len[1]
        assert c.output_len[0] <= r.max_new_tokens <= c.output_len[1]
        assert all(17 <= t < 1000 for t in r.prompt_token_ids)
        assert r.num_prompt_tokens + r.max_new_tokens <= max_request_len(profile)
    share_long = sum(r.kind == "long" for r in trace.requests) / len(trace.requests)
    assert share_long == pytest.approx(0.2, abs=0.04)
    priorities = [r.priority for r in trace.requests]
    for priority, weight in enumerate(config.priority_weights):
        assert priorities.count(priority) / len(priorities) == pytest.approx(weight, abs=0.04)
    assert len({r.request_id for r in trace.requests}) == len(trace.requests)


def test_json_round_trip(tmp_path):
    for rate in (3.0, math.inf):
        trace = generate_trace(TraceConfig(rate=rate, num_requests=20, profile="tiny", seed=5))
        path = tmp_path / "trace.json"
        trace.save(path)
        loaded = Trace.load(path)
        assert loaded.to_json() == trace.to_json()
        assert loaded.config.rate == rate
        assert loaded.num_output_tokens == trace.num_output_tokens


def test_rates_share_requests_and_scale_arrivals():
    slow = generate_trace(TraceConfig(rate=1.0, num_requests=30, seed=2))
    fast = generate_trace(TraceConfig(rate=4.0, num_requests=30, seed=2))
    offline = generate_trace(TraceConfig(rate=0.0, num_requests=30, seed=2))
    for a, b, c in zip(slow.requests, fast.requests, offline.requests):
        assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
        assert a.max_new_tokens == b.max_new_tokens == c.max_new_tokens and a.priority == b.priority == c.priority
        assert b.arrival_s == pytest.approx(a.arrival_s / 4.0)
