"""Producer-side throttling from the workers' status reports.

The rule. The client keeps the latest WorkerStatus of each worker (status topic, key = worker id) and
ignores reports older than `status_max_age_s` (a dead worker must not throttle anyone). Before sending a
request of priority p it asks whether any fresh report says p is *congested*: the worker sheds p
(`priorities[p].shed`), or has paused one of p's request-topic partitions (`priorities[p].paused_partitions`
or the worker-wide `paused_partitions`). While that holds, submit sleeps a jittered, growing delay ("full
jitter": uniform in [0, min(max_delay_s, base_delay_s * 2**k)]) and asks again; it sends anyway once it has
waited `max_total_s` in all, or half the time left before the request's own deadline, whichever is less.
So backoff only ever delays a request by a bounded amount: the worker still has the final word (it answers
`rejected`/`shed` for a priority it sheds), and a client never waits on silence.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from schemas.priority import priority_of_partition
from schemas.status import WorkerStatus


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    enabled: bool = True
    base_delay_s: float = 0.05
    """First delay bound; doubles on each further wait."""
    max_delay_s: float = 1.0
    """Bound of one delay."""
    max_total_s: float = 5.0
    """Longest a request is held back in all before it is sent anyway."""
    status_max_age_s: float = 5.0
    """Status reports older than this (by their ts_ms) are ignored."""

    def delay_bound(self, num_waits: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * (2 ** min(num_waits, 30)))


class StatusBoard:
    """Latest status per worker, and the congestion rule above."""

    def __init__(self, num_request_partitions: int, num_priorities: int) -> None:
        self.num_request_partitions = num_request_partitions
        self.num_priorities = num_priorities
        self.latest: dict[str, WorkerStatus] = {}

    def update(self, status: WorkerStatus) -> None:
        current = self.latest.get(status.worker_id)
        if current is None or status.ts_ms >= current.ts_ms:
            self.latest[status.worker_id] = status

    def fresh(self, max_age_s: float, now_ms: float | None = None) -> list[WorkerStatus]:
        now_ms = time.time() * 1000.0 if now_ms is None else now_ms
        return [s for s in self.latest.values() if now_ms - s.ts_ms <= max_age_s * 1000.0]

    def congestion(self, priority: int, max_age_s: float, now_ms: float | None = None) -> str | None:
        """Why priority is congested per some fresh report ("worker w sheds p", ...), or None."""
        for status in self.fresh(max_age_s, now_ms):
            for entry in status.priorities:
                if entry.priority != priority:
                    continue
                if entry.shed:
                    return f"worker {status.worker_id} sheds priority {priority}"
                if entry.paused_partitions:
                    return f"worker {status.worker_id} paused partitions {entry.paused_partitions}"
            paused = [p for p in status.paused_partitions if self._priority_of(p) == priority]
            if paused:
                return f"worker {status.worker_id} paused partitions {paused}"
        return None

    def refusing_reply_topic(self, topic: str, max_age_s: float, now_ms: float | None = None) -> list[WorkerStatus]:
        """The fresh reports of workers that would not answer on `topic` (it is neither among the reply topics
        nor under a prefix they report allowing): they answer such a request on their result topic instead.
        Workers that report nothing about reply topics are left out."""
        return [status for status in self.fresh(max_age_s, now_ms)
                if status.allowed_reply_topic_prefixes is not None
                and topic not in (status.allowed_reply_topics or [])
                and not any(topic.startswith(prefix) for prefix in status.allowed_reply_topic_prefixes)]

    def _priority_of(self, partition: int) -> int | None:
        if not 0 <= partition < self.num_request_partitions:
            return None  # a worker configured with another layout; its partition numbers mean nothing here
        return priority_of_partition(partition, self.num_request_partitions, self.num_priorities)


async def wait_while_congested(board: StatusBoard, policy: BackoffPolicy, priority: int,
                               deadline_at: float | None = None, rng: random.Random | None = None) -> float:
    """Sleep while `priority` is congested, within the policy's bounds; returns the seconds waited.

    deadline_at: time.monotonic() of the request's own deadline, if it has one.
    """
    if not policy.enabled or board.congestion(priority, policy.status_max_age_s) is None:
        return 0.0
    rng = rng or random
    started = time.monotonic()
    budget = policy.max_total_s
    if deadline_at is not None:
        budget = min(budget, max(0.0, (deadline_at - started) / 2))
    num_waits = 0
    while board.congestion(priority, policy.status_max_age_s) is not None:
        left = budget - (time.monotonic() - started)
        if left <= 0:
            break
        await asyncio.sleep(min(left, rng.uniform(0.0, policy.delay_bound(num_waits))))
        num_waits += 1
    return time.monotonic() - started
