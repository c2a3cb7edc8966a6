"""What one replay of a trace against one system records, and the metrics computed from it.

All times are seconds after the start of the replay (each system's own clock, read the same way), so
systems with different clocks (the engine's time.monotonic, transformers' time.perf_counter) compare.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from benchmarks.lib.stats import latency_summary


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    kind: str
    priority: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    system: str
    rate: float
    """Requests per second of the trace; inf for offline (all at t=0)."""
    records: list[RequestRecord]
    wall_s: float
    """From the start of the replay to the last request's end."""
    kv_utilisation: list[float] = field(default_factory=list)
    """Per step: KV tokens held by running requests / KV slots allocated to them."""
    kv_pool_usage: list[float] = field(default_factory=list)
    """Per step: fraction of the KV budget allocated (paged systems only)."""
    max_concurrent: int | None = None
    """Most requests running at one step; None where the system's internals are not sampled (hf-cb)."""
    extra: dict = field(default_factory=dict)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def compute_metrics(run: RunResult) -> dict:
    """Throughput over the run's wall time and latency percentiles per length class."""
    done = [r for r in run.records if r.finish_s is not None and r.error is None]
    num_output = sum(r.num_output_tokens for r in done)
    metrics = {
        "system": run.system,
        "rate": None if run.rate <= 0 or run.rate == math.inf else run.rate,
        "num_requests": len(run.records),
        "num_completed": len(done),
        "num_errors": sum(r.error is not None for r in run.records),
        "wall_s": run.wall_s,
        "requests_per_s": len(done) / run.wall_s if run.wall_s > 0 else math.nan,
        "output_tokens_per_s": num_output / run.wall_s if run.wall_s > 0 else math.nan,
        "kv_utilisation_mean": _mean(run.kv_utilisation),
        "kv_pool_usage_mean": _mean(run.kv_pool_usage),
        "kv_pool_usage_max": max(run.kv_pool_usage, default=math.nan),
        "max_concurrent": run.max_concurrent,
        "latency": {},
    }
    for kind in sorted({r.kind for r in run.records}) + ["all"]:
        of_kind = [r for r in done if kind in ("all", r.kind)]
        metrics["latency"][kind] = {
            "ttft": latency_summary([r.first_token_s - r.arrival_s for r in of_kind if r.first_token_s is not None]),
            "e2e": latency_summary([r.finish_s - r.arrival_s for r in of_kind]),
        }
    metrics.update(run.extra)
    return metrics


def records_to_json(run: RunResult) -> list[dict]:
    return [asdict(r) for r in run.records]
