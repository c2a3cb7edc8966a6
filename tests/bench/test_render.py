"""The report renderer on a small hand-made results dict (it tests the tables, it claims no numbers)."""

import json

import pytest

from benchmarks.lib.floors import check_floors
from benchmarks.lib.render import render_markdown, render_plots
from benchmarks.report import finite_or_none, summarize


def _metrics(tok_s: float, short_p99: float, sampled: bool = True) -> dict:
    """One run's metrics; sampled=False: no KV figures, as for hf-cb and the Kafka path."""
    lat = {"n": 2, "p50": short_p99 / 2, "p95": short_p99 * 0.9, "p99": short_p99, "mean": 0.0, "max": short_p99}
    return {"output_tokens_per_s": tok_s, "requests_per_s": tok_s / 10,
            "kv_utilisation_mean": 0.9 if sampled else float("nan"),
            "kv_pool_usage_max": 0.5 if sampled else float("nan"), "max_concurrent": 4 if sampled else None,
            "num_completed": 2, "latency": {k: {"ttft": lat, "e2e": lat} for k in ("short", "long", "all")}}


def _results() -> dict:
    points = []
    for system, tok_s, p99 in (("continuous", 100.0, 1.0), ("static", 40.0, 4.0), ("kafka", 95.0, 1.1)):
        for rate in (1.0, None):
            sampled = system != "kafka"
            runs = [_metrics(tok_s, p99, sampled), _metrics(tok_s * 1.1, p99 * 1.2, sampled),
                    _metrics(tok_s * 0.9, p99, sampled)]
            points.append({"system": system, "rate": rate, "summary": summarize(runs), "runs": runs})
    overhead = {"step_s_median": {"median": 0.1, "min": 0.1, "max": 0.1, "n": 3},
                "forward_s_median": {"median": 0.095, "min": 0.09, "max": 0.1, "n": 3},
                "overhead_fraction": {"median": 0.05, "min": 0.04, "max": 0.06, "n": 3}, "num_running": 64, "n": 3}
    return finite_or_none({
        "environment": {"date": "2030-01-01", "cpu_model": "Test CPU", "num_cpus": 2, "torch_threads": 1,
                        "python": "3.11", "torch": "x", "transformers": "y", "load_before": [1.0, 1, 1],
                        "load_after": [2.0, 1, 1]},
        "config": {"model": "m", "profile": "tiny", "block_size": 16},
        "noise_note": "quiet",
        "points": points,
        "kv_capacity": {"kv_budget_bytes": 2**20, "bytes_per_token": 1024, "max_model_len": 1024,
                        "contiguous_max_len_capacity": 1, "paged_capacity_at_trace_lengths": 12,
                        "paged_utilisation_at_trace_lengths": 0.9, "contiguous_utilisation_at_trace_lengths": 0.1,
                        "paged_observed_max_concurrent": 6, "max_num_seqs": 64},
        "overhead": overhead,
        "floors": check_floors(points, overhead),
        "notes": ["a note", "nan stays out of json: " + str(float("nan"))],
    })


def test_floors_are_checked_per_rate():
    floors = _results()["floors"]
    tput = [f for f in floors if f["check"] == "continuous/static output tok/s"]
    assert {f["rate"] for f in tput} == {1.0, None}
    assert all(f["pass"] and abs(f["value"] - 2.5) < 1e-9 for f in tput)
    p99 = [f for f in floors if f["check"] == "continuous/static short e2e p99"]
    assert len(p99) == 2 and all(f["pass"] and abs(f["value"] - 0.25) < 1e-9 for f in p99)
    kafka = [f for f in floors if f["check"] == "kafka/continuous output tok/s"]
    assert [f["rate"] for f in kafka] == [1.0, None] and all(f["pass"] for f in kafka)
    assert floors[-1]["check"].startswith("engine overhead") and floors[-1]["pass"]


def test_markdown_tables():
    results = _results()
    json.dumps(results, allow_nan=False)  # strict JSON
    md = render_markdown(results)
    assert "| CPU | Test CPU (2 cores) |" in md
    assert "| continuous | 1 | 100.0 [90.0–110.0] |" in md
    assert "| static | offline | 40.0 [36.0–44.0] |" in md
    assert "## Floors" in md and "| engine overhead at 64 running | – | 0.05 | <= 0.10 | yes |  |" in md
    assert "| kafka/continuous output tok/s | offline | 0.95 | >= 0.9 | yes | issue #5 |" in md
    assert "| kafka | 1 | 95.0 [85.5–104.5] |" in md
    assert "| kafka | offline | – | – | – |" in md  # KV table: the Kafka path's KV is not sampled
    header = next(line for line in md.splitlines() if line.startswith("| system | rate (req/s)"))
    assert "short e2e p99" in header and "long ttft p50" in header and header.endswith("| all e2e p99 |")
    for line in md.splitlines():
        if line.startswith("| continuous | 1 |"):
            assert line.count("|") == header.count("|")
            break


@pytest.mark.slow  # matplotlib: ~1.5 s
def test_plots(tmp_path):
    results = _results()
    paths = render_plots(results, tmp_path)
    assert [p.name for p in paths] == ["latency_vs_throughput.png", "short_p99_vs_rate.png", "kv_utilisation.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
