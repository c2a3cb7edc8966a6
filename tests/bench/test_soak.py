"""The soak benchmark's bookkeeping: the traffic it sends and how it turns samples into growth figures."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.bench_soak import (
    MIX_WEIGHTS,
    Sample,
    growth,
    kind_at,
    make_request,
    rebalance_step,
    slope_per_1000,
    window_rate,
)
from schemas.decode import decode_request, encode


def test_the_mix_follows_its_weights_and_is_reproducible():
    kinds = Counter(kind_at(i, "mix") for i in range(20_000))
    for kind, weight in MIX_WEIGHTS.items():
        assert kinds[kind] / 20_000 == pytest.approx(weight, abs=0.015)
    assert [kind_at(i, "mix", seed=3) for i in range(50)] == [kind_at(i, "mix", seed=3) for i in range(50)]
    assert {kind_at(i, "schema") for i in range(10)} == {"schema"}


def test_every_request_is_valid_on_the_wire_with_its_own_id_and_schema():
    requests = [make_request(i, kind, 12, "r") for i, kind in enumerate(list(MIX_WEIGHTS) * 30)]
    assert len({r.id for r in requests}) == len(requests)
    for r in requests:
        assert decode_request(encode(r)).id == r.id
    schemas = [encode(r.response_format) for r in requests if r.response_format is not None]
    assert len(set(schemas)) == len(schemas) == 30
    assert make_request(5, "n2", 12, "r").n == 2
    assert make_request(5, "stop", 12, "r").sampling.stop == ["#5#", "\n\n"]


def test_slope_per_1000_and_window_rate():
    assert slope_per_1000([0, 1000, 2000], [10.0, 20.0, 30.0]) == pytest.approx(10.0)
    assert slope_per_1000([5, 5], [1.0, 2.0]) is None
    assert window_rate([0.5, 1.5, 2.5, 3.5], 1.0, 3.0) == pytest.approx(1.0)


def test_growth_ignores_the_warm_up_and_reports_per_1000_finals():
    kb = 1024
    samples = [Sample(t=t, num_sent=0, num_finals=100 * t, rss_bytes=(500_000 + (5_000 if t < 10 else 0) + 3 * t) * kb,
                      python_blocks=1000.0, native_in_use_bytes=200_000.0 * kb)
               for t in range(60)]
    g = growth(samples, warmup_s=10)
    # 3 KB per 100 finals = 30 KB per 1,000; the warm-up's step is not counted.
    assert g["rss_kb_per_1000"] == pytest.approx(30.0)
    assert g["python_blocks_per_1000"] == pytest.approx(0.0)
    assert g["native_in_use_kb_per_1000"] == pytest.approx(0.0)
    assert g["num_finals"] == 4900


def test_a_rebalance_step_compares_the_minute_before_with_the_minute_after_its_burst():
    kb = 1024
    # 100 KB more from the burst on (t 200-219), noise of 1 KB on alternate samples; blocks +50 for good.
    samples = [Sample(t=t, num_sent=0, num_finals=t, rss_bytes=(1000 + (100 if t >= 200 else 0) + t % 2) * kb,
                      python_blocks=10.0 + (50 if t >= 200 else 0), native_in_use_bytes=None)
               for t in range(0, 400, 2)]
    step = rebalance_step(samples, {"joined_s": 200.0, "left_s": 220.0})
    assert step["rss_kb"] == pytest.approx(100.0)
    assert step["python_blocks"] == pytest.approx(50.0)
    assert step["native_in_use_kb"] is None
    # The burst itself (the member's 20 s and the 30 s after) is in neither window.
    spiked = [Sample(t=s.t, num_sent=0, num_finals=s.t, rss_bytes=s.rss_bytes + (10**9 if 200 <= s.t < 250 else 0))
              for s in samples]
    assert rebalance_step(spiked, {"joined_s": 200.0, "left_s": 220.0})["rss_kb"] == pytest.approx(100.0)


def test_mapping_growth_names_the_mappings_that_grew():
    from benchmarks.bench_soak import mapping_growth

    kb = 1024
    first = {"t": 300.0, "num_finals": 2000, "mappings": [
        [0x1000, 8192 * kb, 100 * kb, "[heap]"], [0x7f00000000, 65536 * kb, 4000 * kb, ""],
        [0x7f10001000, 1024 * kb, 1024 * kb, ""], [0x7f20000000, 4096 * kb, 300 * kb, "/usr/lib/libtorch_cpu.so"]]}
    last = {"t": 1800.0, "num_finals": 14000, "mappings": [
        [0x1000, 8192 * kb, 100 * kb, "[heap]"], [0x7f00000000, 65536 * kb, 6500 * kb, ""],
        [0x7f20000000, 4096 * kb, 340 * kb, "/usr/lib/libtorch_cpu.so"], [0x7f30001000, 2048 * kb, 512 * kb, ""],
        [0x7f00000000 + 40 * 2**20, 4096 * kb, 256 * kb, ""]]}
    g = mapping_growth(first, last)
    # The arena gained 2,500 KB and split off a mapping of 256 inside its range, a new mapping 512, one of
    # 1,024 went; the library's pages 40.
    assert g["kb_by_kind"] == {"anonymous, other": -512.0, "file": 40.0, "glibc's other arenas": 2756.0,
                               "main heap": 0.0}
    assert [(m["start"], m["gained_kb"]) for m in g["top"]] == [("0x7f00000000", 2500.0), ("0x7f30001000", 512.0),
                                                                 ("0x7f02800000", 256.0), ("0x7f20000000", 40.0)]
    assert g["finals"] == 12000


def test_the_engine_only_heap_bench_sends_the_soaks_requests_as_the_worker_would():
    from benchmarks.bench_heap import engine_requests

    by_kind = {}
    for i in range(200):
        kind, requests = engine_requests(i, 12)
        by_kind.setdefault(kind, requests)
        assert len({r.request_id for r in requests}) == len(requests)
    assert set(by_kind) == set(MIX_WEIGHTS)
    assert by_kind["schema"][0].sampling.structured.kind == "json_schema"
    first, second = by_kind["n2"]
    assert second.prefix_leader == first.request_id and first.sampling.seed != second.sampling.seed
    assert by_kind["logprobs"][0].sampling.top_logprobs == 3
    assert "\n\n" in by_kind["stop"][0].sampling.stop
    assert len(by_kind["cancel"]) == 1 and by_kind["cancel"][0].sampling.structured is None


def test_the_summary_of_a_run_with_three_rebalances_gives_each_ones_step(tmp_path):
    from benchmarks.bench_soak import Soak, parse_args
    from worker.kafka_settings import KafkaSettings

    soak = Soak(parse_args(["--minutes", "10", "--rebalances", "3"]), KafkaSettings(), tmp_path / "worker.log")
    kb = 1024
    rebalances = [(250.0, 270.0), (350.0, 370.0), (470.0, 490.0)]
    soak.rebalances = [{"joined_s": j, "partitions": [1], "left_s": left} for j, left in rebalances]
    # 200 KB from the first burst on, nothing from the others.
    soak.samples = [Sample(t=t, num_sent=8 * t, num_finals=8 * t, rss_bytes=(1000 + (200 if t >= 250 else 0)) * kb,
                           python_blocks=5.0, native_in_use_bytes=100.0 * kb) for t in range(0, 600, 2)]
    soak.final_times = [t / 8 for t in range(8 * 600)]
    summary = soak.summary(600.0)
    assert [step["rss_kb"] for step in summary["rebalance_steps"]] == [200.0, 0.0, 0.0]
    assert summary["rebalance"] == soak.rebalances[0]
    assert summary["growth_before_rebalance"]["rss_kb_per_1000"] == pytest.approx(0.0)
    assert summary["growth_after_rebalance"]["rss_kb_per_1000"] == pytest.approx(0.0)
    assert summary["finals_per_s"]["last_minute"] == pytest.approx(8.0)


def test_a_run_longer_than_half_an_hour_is_judged_by_each_half_hour_too(tmp_path):
    from benchmarks.bench_soak import Soak, parse_args
    from worker.kafka_settings import KafkaSettings

    soak = Soak(parse_args(["--minutes", "60", "--rebalances", "0"]), KafkaSettings(), tmp_path / "worker.log")
    kb = 1024
    # 1 KB a minute for the first 30 minutes, then flat: the first half hour grew, the second did not.
    soak.samples = [Sample(t=t, num_sent=8 * t, num_finals=8 * t, rss_bytes=(1000 + min(t, 1800) / 60) * kb,
                           python_blocks=5.0, native_in_use_bytes=100.0 * kb) for t in range(0, 3600, 2)]
    soak.final_times = [t / 8 for t in range(8 * 3600)]
    first, second = soak.summary(3600.0)["growth_by_half_hour"]
    assert first["rss_kb_per_1000"] == pytest.approx(1000 / (60 * 8), rel=0.01)  # 1 KB per 480 finals
    assert second["rss_kb_per_1000"] == pytest.approx(0.0, abs=1e-6)
    assert first["num_samples"] == pytest.approx((1800 - 300) / 2, abs=1)  # from the warm-up's end
    assert len(soak.summary(1800.0)["growth_by_half_hour"]) == 1
