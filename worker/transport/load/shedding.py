"""Load shedding by estimated wait: reject a priority's backlog when it cannot be served in time anyway.

Per priority p: backlog_p = the part of its consumer lag (high watermark - position, over this worker's
partitions of p) that will reach the engine, plus requests of p waiting locally, counted in tokens (prompt +
expected output; service_model.py prices an unread record like the recent requests of its priority). Records
that are invalid (dead letters, error answers) cost microseconds, not engine time: `ReachFraction` measures,
per priority, the share of fetched records that were not refused as invalid, and the lag is scaled by it, so a
flood of bad records does not shed the good ones behind it. Requests are served most urgent first, so a
request of p waits behind the backlog of every priority q <= p: est_wait_p = sum(backlog_q for q <= p) /
capacity, the tokens per second the engine serves when saturated (service_model.py: measured while
saturated, else the calibrated step-time model). When est_wait_p exceeds `max_queue_time_for(p)` the priority
is shed: its records are still consumed, but answered with a `rejected`/`shed` final record and committed,
which drains the lag fast. Because est_wait grows with p, the least urgent priorities cross their limit first.
Priority 0 is never shed for lag alone (deadlines still apply to it, in admission.py), nor is a priority whose
limit is 0 (no queue-time bound: by default the bulk priority, whose deadline-free work, batch jobs above all,
waits in Kafka while paused partitions hold it back, instead of being answered `shed` for a backlog it was
meant to wait in). Shedding stops once
est_wait falls below `resume_fraction` of the limit (hysteresis). With no estimate yet nothing is shed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionRate:
    """A count per second (service_model.py feeds it tokens of finished requests), fed at irregular times: the
    decayed count over the decayed time counted. Completions come in lumps (a request's tokens all count when
    it finishes, a batch's requests often finish together), so a rate is only given once `min_seconds` have
    been counted: a first lump over a short interval would otherwise read as many times the true rate, and the
    capacity built on it would hide a backlog (an average of instantaneous rates is swayed the same way)."""

    half_life_s: float = 2.0
    min_seconds: float = 0.0
    rate: float = 0.0
    num_completed: int = 0
    _last_time: float | None = None
    _pending: int = 0
    _count: float = 0.0
    _seconds: float = 0.0

    def record(self, num_completed: int, now: float) -> None:
        self.num_completed += num_completed
        self._pending += num_completed
        if self._last_time is None:
            self._last_time = now
            return
        elapsed = now - self._last_time
        # Fold in only after a minimum interval: instantaneous rates over microseconds are meaningless.
        if elapsed < 0.05:
            return
        decay = math.exp(-elapsed * math.log(2) / self.half_life_s)
        self._count = self._count * decay + self._pending
        self._seconds = self._seconds * decay + elapsed
        if self._seconds >= self.min_seconds:
            self.rate = self._count / self._seconds
        self._pending = 0
        self._last_time = now

    def skip(self, now: float) -> None:
        """The time up to now does not count (e.g. the engine was not saturated): start a new interval."""
        self._pending = 0
        self._last_time = now


PRIOR_RECORDS = 20.0
"""ReachFraction: how many records of the pooled share a priority's own share starts from."""


@dataclass(slots=True)
class ReachFraction:
    """Per priority, an exponentially decayed share of fetched records that were valid requests (queued, or
    refused only for load: shed or deadline). Starts at 1: before anything is seen, every record counts."""

    num_priorities: int
    half_life_records: float = 200.0
    _num_seen: list[float] = field(default_factory=list)
    _num_invalid: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._num_seen = [0.0] * self.num_priorities
        self._num_invalid = [0.0] * self.num_priorities

    def observe(self, priority: int, num_seen: int, num_invalid: int) -> None:
        if num_seen <= 0:
            return
        decay = 0.5 ** (num_seen / self.half_life_records)
        self._num_seen[priority] = self._num_seen[priority] * decay + num_seen
        self._num_invalid[priority] = self._num_invalid[priority] * decay + num_invalid

    def fraction(self, priority: int) -> float:
        """The priority's own share, shrunk toward the share over all priorities by PRIOR_RECORDS imagined
        records (the pooled share itself starts at 1: one imagined valid record). The intake reads the most
        urgent priorities first, so in a sudden flood the least urgent one is judged before any of its records
        was read; borrowing the others' share then keeps thousands of unread bad records from looking like
        work (a flood of 10,000 bad records once had priority 2 shed, valid requests with it)."""
        seen, invalid = self._num_seen[priority], self._num_invalid[priority]
        pooled = 1.0 - sum(self._num_invalid) / (sum(self._num_seen) + 1.0)
        return (seen - invalid + PRIOR_RECORDS * pooled) / (seen + PRIOR_RECORDS)

    def fractions(self) -> list[float]:
        return [self.fraction(p) for p in range(self.num_priorities)]


@dataclass(slots=True, frozen=True)
class ShedDecision:
    shed_priorities: frozenset[int]
    est_wait_s: list[float | None]
    """Per priority, the estimated wait of a new request."""
    backlog: list[int]
    """Per priority, requests waiting or unread (expected to reach the engine)."""
    backlog_tokens: list[float] = field(default_factory=list)

    def message(self, priority: int) -> str:
        wait = self.est_wait_s[priority]
        wait_text = f"{wait:.1f}s" if wait is not None else "unknown"
        tokens = f" (~{self.backlog_tokens[priority]:.0f} tokens)" if self.backlog_tokens else ""
        return (
            f"priority {priority} shed: {self.backlog[priority]} requests{tokens} waiting or unread at this "
            f"priority, estimated wait {wait_text}"
        )


@dataclass(slots=True)
class Shedder:
    max_queue_time_s: list[float]
    """Per priority; the last value covers the rest (WorkerSettings.max_queue_time_for)."""
    num_priorities: int
    resume_fraction: float = 0.8
    shedding: set[int] = field(default_factory=set)

    def limit_for(self, priority: int) -> float:
        return self.max_queue_time_s[min(priority, len(self.max_queue_time_s) - 1)]

    def decide(self, backlog_by_priority: list[int], backlog_tokens: list[float],
               capacity_tokens_per_s: float | None) -> ShedDecision:
        est_wait: list[float | None] = []
        ahead = 0.0
        for priority in range(self.num_priorities):
            ahead += backlog_tokens[priority]
            est_wait.append(ahead / capacity_tokens_per_s if capacity_tokens_per_s else None)
        for priority in range(1, self.num_priorities):
            wait = est_wait[priority]
            limit = self.limit_for(priority)
            if wait is None or limit <= 0:
                self.shedding.discard(priority)
            elif wait > limit:
                self.shedding.add(priority)
            elif wait < self.resume_fraction * limit:
                self.shedding.discard(priority)
        return ShedDecision(frozenset(self.shedding), est_wait, list(backlog_by_priority), list(backlog_tokens))
