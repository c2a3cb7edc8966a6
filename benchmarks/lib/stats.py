"""Percentiles and summaries of benchmark runs (pure Python, no numpy)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default);
    NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/mean/max of a list of latencies (seconds) and how many there were."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else math.nan,
        "max": max(values) if values else math.nan,
    }


def median_min_max(values: Sequence[float]) -> dict[str, float]:
    """Across repetitions of one benchmark point: the median and the range (NaNs dropped)."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": percentile(kept, 50), "min": min(kept), "max": max(kept), "n": len(kept)}


def ratio(numerator: float, denominator: float) -> float:
    if denominator == 0 or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator
