"""floors.check_floors on synthetic points (no model, no Kafka), and the --systems parsing."""

import math

import pytest

from benchmarks.lib.floors import check_floors, p99_e2e
from benchmarks.report import DEFAULT_SYSTEMS, kafka_timeout_s, offline_systems, parse_systems
from benchmarks.lib.trace import Trace, TraceConfig, TraceRequest


def _stat(value: float | None) -> dict:
    return {"median": value, "min": value, "max": value, "n": 0 if value is None else 1}


def _point(system: str, rate: float | None, tok_s: float, p99: float = 1.0, *, all_p99: float | None = -1.0) -> dict:
    """A point whose short and long e2e p99 are `p99`; all-requests p99 is `all_p99` (default: the same as p99,
    None: the key is absent, as in results written before it existed)."""
    summary = {"output_tokens_per_s": _stat(tok_s), "short_e2e_p99": _stat(p99), "long_e2e_p99": _stat(p99)}
    if all_p99 is not None:
        summary["all_e2e_p99"] = _stat(p99 if all_p99 == -1.0 else all_p99)
    return {"system": system, "rate": rate, "summary": summary}


def _named(floors: list[dict], prefix: str) -> list[dict]:
    return [f for f in floors if f["check"].startswith(prefix)]


ALL = "continuous sustained / static output tok/s, p99 e2e < 10 s"
SHORT = "continuous sustained / static output tok/s, short p99 e2e < 10 s"


def test_static_floor_compares_continuous_sustained_with_static_at_its_highest_rate_under_10s():
    points = [
        _point("continuous", 0.5, 30.0), _point("static", 0.5, 20.0, p99=4.0),
        _point("continuous", 1.0, 50.0), _point("static", 1.0, 20.0, p99=9.5),
        _point("continuous", 2.0, 60.0, p99=8.0), _point("static", 2.0, 25.0, p99=30.0),
        _point("continuous", None, 70.0, p99=12.0), _point("static", None, 25.0, p99=40.0),
    ]
    floors = check_floors(points, None)
    (f,) = _named(floors, ALL)
    # static's highest rate under 10 s is 1 req/s (20 tok/s); continuous sustains 60 tok/s under 10 s (at 2
    # req/s: offline's 70 tok/s came with a 12 s p99).
    assert f["rate"] == 1.0 and f["value"] == pytest.approx(3.0) and f["pass"]
    assert "continuous at 2 req/s" in f["note"]
    (g,) = _named(floors, SHORT)
    assert g["rate"] == 1.0 and g["value"] == pytest.approx(3.0)
    # The per-rate checks stay, one pair per rate, finite rates in order and offline last.
    assert [g["rate"] for g in floors if g["check"] == "continuous/static output tok/s"] == [0.5, 1.0, 2.0, None]
    assert len([g for g in floors if g["check"] == "continuous/static short e2e p99"]) == 4


def test_static_floor_uses_all_requests_p99_then_short_and_long():
    # The all-requests p99 (12 s) decides, even though short and long alone would pass (9 s).
    points = [_point("continuous", 1.0, 50.0), _point("static", 1.0, 20.0, p99=9.0, all_p99=12.0)]
    floors = check_floors(points, None)
    (f,) = _named(floors, ALL)
    assert f["value"] is None and not f["pass"]
    (g,) = _named(floors, SHORT)  # the short-request form sees 9 s
    assert g["pass"] and g["value"] == pytest.approx(2.5)
    # Without an all-requests p99, both short and long must stay under 10 s.
    old = _point("static", 1.0, 20.0, p99=9.0, all_p99=None)
    old["summary"]["long_e2e_p99"] = _stat(11.0)
    assert p99_e2e(old["summary"]) == 11.0
    (f,) = _named(check_floors([_point("continuous", 1.0, 50.0), old], None), ALL)
    assert not f["pass"] and f["value"] is None
    old["summary"]["long_e2e_p99"] = _stat(8.0)
    (f,) = _named(check_floors([_point("continuous", 1.0, 50.0), old], None), ALL)
    assert f["pass"] and f["rate"] == 1.0


def test_static_floor_when_no_rate_keeps_static_p99_under_10s():
    points = [_point("continuous", 1.0, 50.0), _point("static", 1.0, 10.0, p99=10.0),
              _point("continuous", None, 60.0), _point("static", None, 10.0, p99=25.0)]
    (f,) = _named(check_floors(points, None), ALL)
    assert f["value"] is None and f["pass"] is False
    assert f["note"] == "static p99 e2e ≥ 10 s at every rate measured"


def test_static_floor_when_continuous_never_stays_under_10s_either():
    points = [_point("continuous", 1.0, 50.0, p99=11.0), _point("static", 1.0, 10.0, p99=5.0)]
    (f,) = _named(check_floors(points, None), ALL)
    assert f["value"] is None and not f["pass"] and f["note"].startswith("continuous p99 e2e")


def test_hf_cb_floor_at_saturation():
    points = [_point("continuous", 0.5, 20.0), _point("hf-cb", 0.5, 20.0),
              _point("continuous", 2.0, 45.0), _point("hf-cb", 2.0, 30.0),
              _point("continuous", 4.0, 47.0)]  # hf-cb did not run at 4: saturation is 2 req/s
    (f,) = _named(check_floors(points, None), "continuous/hf-cb")
    assert f["rate"] == 2.0 and f["value"] == pytest.approx(1.5) and f["pass"] and f["floor"] == ">= 1.5"
    points += [_point("continuous", None, 40.0), _point("hf-cb", None, 30.0)]  # offline beats every rate
    (f,) = _named(check_floors(points, None), "continuous/hf-cb")
    assert f["rate"] is None and f["value"] == pytest.approx(4 / 3) and not f["pass"]


def test_kafka_floor_at_every_rate_where_both_ran():
    points = [_point("continuous", 1.0, 20.0), _point("kafka", 1.0, 19.0),
              _point("continuous", None, 30.0), _point("kafka", None, 25.0),
              _point("continuous", 2.0, 25.0)]
    floors = _named(check_floors(points, None), "kafka/continuous")
    assert [(f["rate"], f["pass"]) for f in floors] == [(1.0, True), (None, False)]
    assert floors[0]["value"] == pytest.approx(0.95) and floors[0]["floor"] == ">= 0.9"
    # With kafka requested, a rate where no Kafka run completed fails instead of going missing.
    floors = _named(check_floors(points, None, systems=["continuous", "kafka"]), "kafka/continuous")
    assert [(f["rate"], f["value"], f["pass"]) for f in floors] == [
        (1.0, pytest.approx(0.95), True), (2.0, None, False), (None, pytest.approx(25 / 30), False)]
    # An offline point that kafka was not chosen for (--offline-systems) is no failure.
    points = [_point("continuous", 1.0, 20.0), _point("kafka", 1.0, 19.0), _point("continuous", None, 30.0)]
    floors = _named(check_floors(points, None, systems=["continuous", "kafka"], offline=["continuous"]),
                    "kafka/continuous")
    assert [(f["rate"], f["pass"]) for f in floors] == [(1.0, True)]
    floors = _named(check_floors(points, None, systems=["continuous", "kafka"]), "kafka/continuous")
    assert [(f["rate"], f["pass"]) for f in floors] == [(1.0, True), (None, False)]


def test_floors_need_both_systems_and_overhead_comes_last():
    overhead = {"overhead_fraction": {"median": 0.02}, "num_running": 64}
    floors = check_floors([_point("continuous", 1.0, 20.0), _point("kafka", 1.0, float("nan"))], overhead)
    assert [f["check"] for f in floors] == ["kafka/continuous output tok/s", "engine overhead at 64 running"]
    assert not floors[0]["pass"] and math.isnan(floors[0]["value"])
    assert check_floors([_point("static", 1.0, 20.0), _point("hf-cb", 1.0, 20.0)], None) == []


def test_paged_kv_floor_before_overhead():
    kv = {"kv_budget_bytes": 256 * 2**20, "contiguous_max_len_capacity": 5, "paged_capacity_at_trace_lengths": 46,
          "paged_observed_max_concurrent": 48}
    overhead = {"overhead_fraction": {"median": 0.02}, "num_running": 64}
    floors = check_floors([], overhead, kv_capacity=kv)
    assert [f["check"] for f in floors] == ["paged / contiguous max-length KV: requests that fit",
                                            "engine overhead at 64 running"]
    assert floors[0]["value"] == pytest.approx(9.2) and floors[0]["pass"] and "48 ran at once" in floors[0]["note"]
    kv.update(paged_capacity_at_trace_lengths=14)
    assert not check_floors([], None, kv_capacity=kv)[0]["pass"]


def test_systems_parsing_accepts_kafka_and_defaults_to_every_system():
    assert "kafka" in DEFAULT_SYSTEMS and set(DEFAULT_SYSTEMS) >= {"continuous", "dynamic", "static", "hf-static",
                                                                   "hf-cb"}
    assert parse_systems(",".join(DEFAULT_SYSTEMS)) == list(DEFAULT_SYSTEMS)
    assert parse_systems(" continuous, kafka ,,continuous") == ["continuous", "kafka"]
    with pytest.raises(ValueError, match="unknown systems"):
        parse_systems("continuous,kafak")


def test_offline_point_skips_hf_static_unless_named():
    systems = list(DEFAULT_SYSTEMS)
    assert offline_systems(systems, None) == [s for s in systems if s != "hf-static"]
    assert offline_systems(systems, "hf-cb,continuous") == ["continuous", "hf-cb"]  # in the sweep's order
    assert offline_systems(["continuous", "static"], None) == ["continuous", "static"]
    with pytest.raises(ValueError, match="not in --systems"):
        offline_systems(["continuous"], "continuous,hf-cb")


def test_kafka_timeout_is_generous():
    trace = Trace(TraceConfig(rate=1.0, num_requests=2), [TraceRequest("r0", 0.0, [20], 4, 1, "short"),
                                                          TraceRequest("r1", 50.0, [21], 4, 1, "short")])
    assert kafka_timeout_s(trace) == 500.0
    assert kafka_timeout_s(trace, [20.0, 70.0]) == 700.0
    assert kafka_timeout_s(Trace(TraceConfig(rate=0.0, num_requests=0))) == 300.0
