"""The worker's local queue: decoded, admitted requests waiting to enter the engine, one FIFO per priority.

Here a request can still be shed, rejected on its deadline or overtaken by a more urgent one; the engine
sees it only when the dispatcher (dispatcher.py) moves it in. Pure: partitions are opaque hashable keys.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from schemas.request import GenerationRequest


@dataclass(slots=True)
class QueuedRequest:
    """A decoded request record and where it came from."""

    request: GenerationRequest
    partition: Hashable
    """The TopicPartition it came from."""
    offset: int
    priority: int
    attempt: int
    timestamp_ms: int
    """The record's Kafka timestamp (epoch ms)."""
    deadline_ms: int | None
    reply_topic: str
    num_prompt_tokens: int
    """Estimated (admission.estimate_prompt_tokens): the tokenizer lives in the engine."""
    arrival_ms: float | None = None
    """When it counts as arrived for queue order and preemption (epoch ms): the record's timestamp, bounded
    below by the fetch time minus WORKER_MAX_CLOCK_SKEW_MS (a producer's clock cannot jump the queue). None:
    the record's timestamp."""
    engine_id: str = ""
    """"<wire id>#<attempt>@<partition>:<offset>": unique in the engine even for a duplicate wire id."""
    expected_tokens: float = 0.0
    """Expected prompt + output tokens (service_model.ServiceModel.expected_cost), for load estimates."""
    predicted_queue_ms: float | None = None
    """At intake: predicted time from the record's timestamp to its first step (reported in the final)."""
    predicted_e2e_ms: float | None = None
    """At intake: predicted time from the record's timestamp to its last token, if it runs to max_new_tokens."""
    trace: object | None = None
    """A tracing.RequestTrace when its record carried a traceparent and tracing is on."""

    def completion_engine_id(self, index: int) -> str:
        """The engine id of completion `index`: engine_id itself when the request asks for one completion."""
        return self.engine_id if self.request.num_completions == 1 else f"{self.engine_id}/{index}"

    def __post_init__(self) -> None:
        if self.arrival_ms is None:
            self.arrival_ms = float(self.timestamp_ms)
        if not self.engine_id:
            partition = getattr(self.partition, "partition", self.partition)
            self.engine_id = f"{self.request.id}#{self.attempt}@{partition}:{self.offset}"


class LocalQueue:
    """Per-priority FIFOs with a `space` event that is set whenever fewer than `max_waiting` requests wait."""

    def __init__(self, num_priorities: int, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._by_priority: list[deque[QueuedRequest]] = [deque() for _ in range(num_priorities)]
        self._tokens = [0.0] * num_priorities
        self.space = asyncio.Event()
        self.space.set()
        self.max_num_waiting_seen = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_priority)

    def num_waiting(self, priority: int) -> int:
        return len(self._by_priority[priority])

    def num_waiting_by_priority(self) -> list[int]:
        return [len(q) for q in self._by_priority]

    def tokens_by_priority(self) -> list[float]:
        """Per priority, the expected tokens of the requests waiting (QueuedRequest.expected_tokens)."""
        return [max(0.0, t) for t in self._tokens]

    def push(self, queued: QueuedRequest) -> None:
        self._by_priority[queued.priority].append(queued)
        self._tokens[queued.priority] += queued.expected_tokens
        self.max_num_waiting_seen = max(self.max_num_waiting_seen, len(self))
        if len(self) >= self.max_waiting:
            self.space.clear()

    def head(self, priority: int) -> QueuedRequest | None:
        queue = self._by_priority[priority]
        return queue[0] if queue else None

    def pop(self, priority: int) -> QueuedRequest:
        queued = self._by_priority[priority].popleft()
        self._tokens[priority] -= queued.expected_tokens
        self._note_space()
        return queued

    def pop_all(self, priority: int) -> list[QueuedRequest]:
        taken = list(self._by_priority[priority])
        self._by_priority[priority].clear()
        self._tokens[priority] = 0.0
        self._note_space()
        return taken

    def take_partitions(self, partitions: set) -> list[QueuedRequest]:
        """Remove and return the requests of these partitions, in queue order per priority."""
        taken: list[QueuedRequest] = []
        for priority, queue in enumerate(self._by_priority):
            kept = [q for q in queue if q.partition not in partitions]
            taken += [q for q in queue if q.partition in partitions]
            queue.clear()
            queue.extend(kept)
            self._tokens[priority] = sum(q.expected_tokens for q in kept)
        self._note_space()
        return taken

    def take_where(self, predicate: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        """Remove and return the requests that match (cancelled ones), in queue order per priority."""
        taken: list[QueuedRequest] = []
        for priority, queue in enumerate(self._by_priority):
            if not any(predicate(q) for q in queue):
                continue
            kept = [q for q in queue if not predicate(q)]
            taken += [q for q in queue if predicate(q)]
            queue.clear()
            queue.extend(kept)
            self._tokens[priority] = sum(q.expected_tokens for q in kept)
        if taken:
            self._note_space()
        return taken

    def restore(self, requests: list[QueuedRequest]) -> None:
        """Put requests taken by take_partitions back at the front of their queues, in their order."""
        for queued in reversed(requests):
            self._by_priority[queued.priority].appendleft(queued)
            self._tokens[queued.priority] += queued.expected_tokens
        if len(self) >= self.max_waiting:
            self.space.clear()

    def __iter__(self) -> Iterator[QueuedRequest]:
        for queue in self._by_priority:
            yield from queue

    def _note_space(self) -> None:
        if len(self) < self.max_waiting:
            self.space.set()
