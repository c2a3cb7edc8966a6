"""Pure helpers of the simulated-GPU Kafka benchmark: token times, points, the trace and the worker's env."""

import math

import pytest

from benchmarks.bench_sim_kafka import OUTPUT_LEN, PROMPT_LEN, floor_verdict, parse_point, settings_env, sim_trace
from benchmarks.lib.token_times import TokenTimes
from worker.model.settings import EngineSettings


def test_itl_spreads_a_coalesced_chunk_over_its_tokens_and_ttft_is_the_first_delivery():
    t = TokenTimes()
    t.add("a", 0.10, 1)
    t.add("a", 0.11, 1)
    t.add("a", 0.15, 4)  # 4 tokens coalesced over 40 ms: 10 ms each
    t.add("b", 0.20, 0)  # an empty chunk is no delivery
    t.add("b", 0.30, 2)
    assert t.ttfts() == [0.10, 0.30]
    assert t.ttfts({"a": 0.05}) == pytest.approx([0.05, 0.30])
    assert t.itls() == pytest.approx([0.01] * 5)
    assert t.delivery_gaps() == pytest.approx([0.01, 0.04])
    s = t.summary()
    assert (s["num_requests"], s["num_tokens"], s["num_deliveries"]) == (2, 8, 4)
    assert s["itl_p99_ms"] == pytest.approx(10.0) and s["ttft_p50_ms"] == pytest.approx(200.0)


def test_empty_times_give_nan_percentiles():
    s = TokenTimes().summary()
    assert s["num_tokens"] == 0 and math.isnan(s["itl_p50_ms"])


def test_parse_point():
    assert parse_point("llama-3.1-8b@256") == ("llama-3.1-8b", 256)
    for bad in ("llama-3.1-8b", "@64", "x@0", "x@a"):
        with pytest.raises(ValueError):
            parse_point(bad)


def test_sim_trace_is_offline_seeded_and_in_range():
    trace = sim_trace(50, seed=3, low=17, vocab_size=49152)
    assert trace == sim_trace(50, seed=3, low=17, vocab_size=49152)
    assert len(trace.requests) == 50 and all(r.arrival_s == 0.0 for r in trace.requests)
    assert all(PROMPT_LEN[0] <= r.num_prompt_tokens <= PROMPT_LEN[1] for r in trace.requests)
    assert all(OUTPUT_LEN[0] <= r.max_new_tokens <= OUTPUT_LEN[1] for r in trace.requests)
    assert all(17 <= i < 49152 for r in trace.requests for i in r.prompt_token_ids)


def test_settings_env_round_trips_through_engine_settings(monkeypatch):
    settings = EngineSettings(device="sim:h200", sim_model="llama-3.1-8b", max_num_seqs=256,
                              max_num_batched_tokens=8192, max_model_len=512, enable_prefix_caching=False)
    env = settings_env(settings, 50.0)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert EngineSettings() == settings
    assert env["WORKER_CHUNK_INTERVAL_MS"] == "50.0"


def test_floor_verdict_reads_the_default_interval_at_the_floor_point():
    rows = [{"point": "llama-3.1-8b@256", "system": "kafka", "chunk_interval_ms": 0.0, "vs_engine": 0.80},
            {"point": "llama-3.1-8b@256", "system": "kafka", "chunk_interval_ms": 50.0, "vs_engine": 0.95}]
    assert floor_verdict(rows, 0.0)["meets_floor"] is False
    assert floor_verdict(rows, 50.0)["value"] == 0.95 and floor_verdict(rows, 50.0)["meets_floor"] is True
    assert floor_verdict(rows[:0], 0.0)["value"] is None
    rows.append({**rows[0], "vs_engine": 0.90})
    rows.append({**rows[0], "vs_engine": 0.88})
    assert floor_verdict(rows, 0.0)["value"] == 0.88 and floor_verdict(rows, 0.0)["meets_floor"] is True
