"""The pure parts of the load generator: workload specs (priority mix, length and deadline distributions),
percentiles, and the per-priority summary table. No Kafka, no asyncio: unit-tested in milliseconds.

Length distributions are mixtures of integer ranges, written `WEIGHT:LO-HI,WEIGHT:LO-HI,...`: a component
is picked by weight, then a length uniformly in [LO, HI]. "0.8:8-32,0.2:200-600" gives many short prompts and
a tail of long ones. "16" and "8-64" are shorthands for one component.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

STATUSES = ("completed", "rejected", "error", "timeout")
"""Outcomes of one request: the three wire statuses, plus `timeout` when no final record came in time."""


def _parse_range(text: str) -> tuple[int, int]:
    lo_text, _, hi_text = text.partition("-")
    lo, hi = int(lo_text), int(hi_text or lo_text)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad range {text!r}: need 1 <= LO <= HI")
    return lo, hi


@dataclass(frozen=True, slots=True)
class LengthDist:
    components: tuple[tuple[float, int, int], ...]
    """(weight, lo, hi); weights sum to 1."""

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        components = []
        for part in spec.replace(" ", "").split(","):
            weight_text, sep, range_text = part.rpartition(":")
            weight = float(weight_text) if sep else 1.0
            if not weight > 0:
                raise ValueError(f"bad weight in {part!r}: must be > 0")
            components.append((weight, *_parse_range(range_text)))
        total = sum(w for w, _, _ in components)
        return cls(tuple((w / total, lo, hi) for w, lo, hi in components))

    def sample(self, rng: random.Random) -> int:
        weights = [w for w, _, _ in self.components]
        _, lo, hi = rng.choices(self.components, weights=weights)[0]
        return rng.randint(lo, hi)

    @property
    def mean(self) -> float:
        return sum(w * (lo + hi) / 2 for w, lo, hi in self.components)


def parse_priority_mix(spec: str, num_priorities: int) -> dict[int, float]:
    """ "0:0.2,1:0.3,2:0.5" -> {0: 0.2, 1: 0.3, 2: 0.5}, normalized to sum 1."""
    mix: dict[int, float] = {}
    for part in spec.replace(" ", "").split(","):
        priority_text, sep, weight_text = part.partition(":")
        if not sep:
            raise ValueError(f"bad priority mix entry {part!r}: expected PRIORITY:WEIGHT")
        priority, weight = int(priority_text), float(weight_text)
        if not 0 <= priority < num_priorities:
            raise ValueError(f"priority {priority} is outside 0..{num_priorities - 1}")
        if weight < 0:
            raise ValueError(f"negative weight for priority {priority}")
        mix[priority] = mix.get(priority, 0.0) + weight
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("the priority mix has no positive weight")
    return {p: w / total for p, w in sorted(mix.items()) if w > 0}


def parse_deadlines(spec: str, num_priorities: int) -> dict[int, float | None]:
    """Seconds per priority: "none", "30" (all priorities) or "0:5,1:15,2:30" (unnamed ones get none)."""
    spec = spec.replace(" ", "")
    if spec.lower() in ("", "none"):
        return {p: None for p in range(num_priorities)}
    if ":" not in spec:
        return {p: float(spec) for p in range(num_priorities)}
    deadlines: dict[int, float | None] = {p: None for p in range(num_priorities)}
    for part in spec.split(","):
        priority_text, _, seconds_text = part.partition(":")
        priority = int(priority_text)
        if not 0 <= priority < num_priorities:
            raise ValueError(f"priority {priority} is outside 0..{num_priorities - 1}")
        deadlines[priority] = float(seconds_text)
    return deadlines


def poisson_gaps(rate: float, rng: random.Random):
    """Inter-arrival times (seconds) of a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    while True:
        yield rng.expovariate(rate)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _latency_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    return {f"p{q}": (None if (v := percentile(ms, q)) is None else round(v, 1)) for q in (50, 95, 99)}


def summarize(records: list[dict], wall_s: float) -> dict[str, dict]:
    """Per priority (as a string key) and "all": counts by status and reason, throughput, and client-side TTFT
    and end-to-end percentiles in ms over completed requests. Each record needs priority, status, reason,
    completion_tokens, ttft_s and e2e_s."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(str(record["priority"]), []).append(record)
    groups = dict(sorted(groups.items()))
    groups["all"] = list(records)
    wall_s = max(wall_s, 1e-9)
    table = {}
    for key, group in groups.items():
        done = [r for r in group if r["status"] == "completed"]
        by_status = {status: sum(1 for r in group if r["status"] == status) for status in STATUSES}
        reasons: dict[str, dict[str, int]] = {}
        for r in group:
            if r["status"] in ("rejected", "error"):
                bucket = reasons.setdefault(r["status"], {})
                bucket[r["reason"]] = bucket.get(r["reason"], 0) + 1
        num_tokens = sum(r["completion_tokens"] for r in done)
        table[key] = {
            "num_sent": len(group),
            **{f"num_{status}": count for status, count in by_status.items()},
            "rejected_by_reason": reasons.get("rejected", {}),
            "errors_by_reason": reasons.get("error", {}),
            "completed_per_s": round(len(done) / wall_s, 3),
            "output_tokens_per_s": round(num_tokens / wall_s, 1),
            "ttft_ms": _latency_ms([r["ttft_s"] for r in done if r["ttft_s"] is not None]),
            "e2e_ms": _latency_ms([r["e2e_s"] for r in done if r["e2e_s"] is not None]),
        }
    return table


def format_table(table: dict[str, dict]) -> str:
    """The summary as fixed-width text, one row per priority and one for all."""
    def cell(value) -> str:
        return "-" if value is None else f"{value:.0f}"

    header = (f"{'prio':>4} {'sent':>6} {'done':>6} {'rej':>5} {'err':>4} {'t/o':>4} {'req/s':>7} {'tok/s':>7}  "
              f"{'TTFT p50/p95/p99 ms':>21}  {'e2e p50/p95/p99 ms':>21}")
    lines = [header, "-" * len(header)]
    for key, row in table.items():
        ttft, e2e = row["ttft_ms"], row["e2e_ms"]
        ttft_text = "/".join(cell(ttft[q]) for q in ("p50", "p95", "p99"))
        e2e_text = "/".join(cell(e2e[q]) for q in ("p50", "p95", "p99"))
        lines.append(
            f"{key:>4} {row['num_sent']:>6} {row['num_completed']:>6} {row['num_rejected']:>5} {row['num_error']:>4} "
            f"{row['num_timeout']:>4} {row['completed_per_s']:>7.2f} {row['output_tokens_per_s']:>7.1f}  "
            f"{ttft_text:>21}  {e2e_text:>21}"
        )
    reasons = {key: {**row["rejected_by_reason"], **row["errors_by_reason"]} for key, row in table.items()}
    reason_text = "; ".join(f"p{key}: " + ", ".join(f"{r}={n}" for r, n in sorted(counts.items()))
                            for key, counts in reasons.items() if counts and key != "all")
    if reason_text:
        lines.append(f"rejected/error reasons: {reason_text}")
    return "\n".join(lines)
