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
