"""Which waiting requests may start now: the batching policy, and the waiting queue it orders.

The scheduler runs one token-budget loop for every policy; a policy only orders the waiting queue (and the
choice of preemption victim) and names the requests that may be admitted at a step.

continuous  Iteration-level batching: every waiting request is a candidate at every step, in priority order
            (lower number first); within a priority by fair tag (the tenant's virtual token counter when it
            entered the engine: fair share among tenants, see api.EngineRequest.fair_tag), then first come
            first served by arrival time.
dynamic     When no batch is in flight, a batch forms from the first max_batch_size waiting requests in
            priority order as soon as max_batch_size requests wait, or the oldest waiting request (by
            arrival_time) has waited batch_window_ms (now - arrival_time >= window). Nobody else is admitted
            until every member has finished.
static      Fixed batches in arrival order, priority ignored: when no batch is in flight, a batch forms from the
            first max_batch_size waiting requests by arrival once max_batch_size requests wait or, after
            set_input_ended() (no more requests expected for now: the end of a trace, or a Kafka consumer that caught
            up with its partitions), from whatever waits. Runs to
            completion like dynamic.
Members of a batch are admitted under the same token budget, block and max_num_seqs limits as any request
(chunked prefill), so a batch may need several steps to be fully running; a preempted member stays a member
and is readmitted; members that finish while waiting (deadline, abort) leave the batch.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from worker.engine.request import Request, RequestStatus

PolicyName = Literal["continuous", "dynamic", "static"]


class WaitingQueue:
    """Waiting requests sorted by (policy key, add order), with lookup by id and a heap of deadlines, and the
    counts the scheduler reads at every step kept as requests come and go (a walk over thousands of waiting
    requests at every step would cost the host milliseconds)."""

    __slots__ = ("_order_key", "_entries", "_entry_by_id", "_deadlines", "_counted", "_by_priority",
                 "_with_deadline_by_priority", "num_prompt_tokens", "num_preempted_with_deadline")

    def __init__(self, order_key: Callable[[Request], tuple]) -> None:
        self._order_key = order_key
        self._entries: list[tuple[tuple, int, Request]] = []
        self._entry_by_id: dict[str, tuple[tuple, int, Request]] = {}
        # (deadline, add order, request id): an entry whose request left the queue is skipped when popped, and
        # the heap is rebuilt once such entries outnumber the waiting requests, so a far deadline keeps neither a
        # finished request nor its entry for long.
        self._deadlines: list[tuple[float, int, str]] = []
        self._counted: dict[str, tuple[int, int, bool, bool]] = {}
        """What each request adds to the counts below, as it was when pushed (its status changes before it
        leaves: an admitted request is RUNNING when removed)."""
        self._by_priority: list[int] = [0]
        self._with_deadline_by_priority: list[int] = [0]
        self.num_prompt_tokens = 0
        """Prompt tokens of the waiting requests (a waiting request has none computed: it holds no KV)."""
        self.num_preempted_with_deadline = 0
        """Waiting requests that ran before (preempted) and have a deadline."""

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entry_by_id

    def push(self, request: Request, add_order: int) -> None:
        """`add_order` breaks ties between equal keys and must be unique per request."""
        assert request.request_id not in self._entry_by_id, request.request_id
        entry = (self._order_key(request), add_order, request)
        bisect.insort(self._entries, entry)
        self._entry_by_id[request.request_id] = entry
        has_deadline = request.deadline is not None
        counted = (max(request.priority, 0), request.num_prompt_tokens,
                   request.status is RequestStatus.PREEMPTED and has_deadline, has_deadline)
        self._counted[request.request_id] = counted
        self._count(counted, 1)
        # Only requests that never ran can be dropped for their deadline (see Scheduler.schedule).
        if request.deadline is not None and request.status is RequestStatus.WAITING:
            heapq.heappush(self._deadlines, (request.deadline, add_order, request.request_id))

    def remove(self, request: Request) -> None:
        entry = self._entry_by_id.pop(request.request_id)
        index = bisect.bisect_left(self._entries, entry[:2])
        assert self._entries[index][2] is request, request.request_id
        del self._entries[index]
        self._count(self._counted.pop(request.request_id), -1)
        if len(self._deadlines) > 2 * len(self._entries) + 64:
            self._deadlines = [item for item in self._deadlines if self._droppable(item) is not None]
            heapq.heapify(self._deadlines)

    def _count(self, counted: tuple[int, int, bool, bool], sign: int) -> None:
        priority, num_prompt_tokens, preempted_with_deadline, has_deadline = counted
        by_priority, with_deadline = self._by_priority, self._with_deadline_by_priority
        while len(by_priority) <= priority:
            by_priority.append(0)
            with_deadline.append(0)
        by_priority[priority] += sign
        with_deadline[priority] += sign * has_deadline
        self.num_prompt_tokens += sign * num_prompt_tokens
        self.num_preempted_with_deadline += sign * preempted_with_deadline

    def num_by_priority(self) -> tuple[int, ...]:
        """Waiting requests by priority 0 .. the largest waiting (a priority below 0, which the engine allows and
        the wire does not, counts as 0); (0,) when none wait."""
        by_priority = self._by_priority
        last = len(by_priority) - 1
        while last > 0 and not by_priority[last]:
            last -= 1
        return tuple(by_priority[: last + 1])

    def any_with_deadline_below(self, priority: int) -> bool:
        """Whether a waiting request of a priority below `priority` may have a deadline: exact for priorities of
        0 and above; any request below 0 with a deadline (counted at 0) makes it True for every `priority`."""
        if priority <= 0:
            return bool(self._with_deadline_by_priority[0])
        return any(self._with_deadline_by_priority[:priority])

    def check_counts(self) -> None:
        """The kept counts against a walk over the queue (Scheduler.check_invariants)."""
        requests = [entry[2] for entry in self._entries]
        by_priority = [0] * (max((max(r.priority, 0) for r in requests), default=0) + 1)
        for request in requests:
            by_priority[max(request.priority, 0)] += 1
        assert self.num_by_priority() == tuple(by_priority), (self.num_by_priority(), by_priority)
        assert self.num_prompt_tokens == sum(r.num_prompt_tokens for r in requests)
        assert self.num_preempted_with_deadline == sum(
            r.status is RequestStatus.PREEMPTED and r.deadline is not None for r in requests)
        for priority in range(-1, len(self._with_deadline_by_priority) + 1):
            below = any(r.priority < priority and r.deadline is not None for r in requests)
            assert self.any_with_deadline_below(priority) >= below, priority  # never misses one
            if priority > 0:
                assert self.any_with_deadline_below(priority) == any(
                    max(r.priority, 0) < priority and r.deadline is not None for r in requests), priority

    def first(self, num: int) -> list[Request]:
        return [entry[2] for entry in self._entries[:num]]

    def oldest_arrival_time(self) -> float | None:
        return min((entry[2].arrival_time for entry in self._entries), default=None)

    def earliest_deadline(self) -> float | None:
        """Earliest deadline among the waiting requests that may be dropped for it."""
        while self._deadlines and self._droppable(self._deadlines[0]) is None:
            heapq.heappop(self._deadlines)  # stale for good: a request never returns to WAITING
        return self._deadlines[0][0] if self._deadlines else None

    def pop_expired(self, now: float) -> list[Request]:
        """Remove and return the never-run waiting requests whose deadline is <= now."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            request = self._droppable(heapq.heappop(self._deadlines))
            if request is not None:
                self.remove(request)
                expired.append(request)
        return expired

    def _droppable(self, item: tuple[float, int, str]) -> Request | None:
        """The request of a deadline entry while it still waits, never having run; None once the entry is stale
        (the add order tells a request pushed again under the same id from the one the entry was made for)."""
        entry = self._entry_by_id.get(item[2])
        if entry is None or entry[1] != item[1] or entry[2].status is not RequestStatus.WAITING:
            return None
        return entry[2]


@dataclass(slots=True)
class AdmissionPolicy:
    name: PolicyName
    max_batch_size: int
    batch_window_s: float
    input_ended: bool = False
    """static: set by Scheduler.set_input_ended(); partial batches may start."""
    batch: list[Request] = field(default_factory=list)
    """dynamic, static: members of the batch in flight, in queue order at formation (finished ones are pruned
    at the next candidates() call)."""

    def __post_init__(self) -> None:
        assert self.name in ("continuous", "dynamic", "static"), self.name
        assert self.max_batch_size >= 1 and self.batch_window_s >= 0

    def order_key(self, request: Request) -> tuple:
        """Waiting-queue order; the preemption victim is the running request with the largest key."""
        if self.name == "static":
            return (request.arrival_time,)
        return (request.priority, request.fair_tag, request.arrival_time)

    def candidates(self, waiting: WaitingQueue, now: float) -> Iterable[Request]:
        """Waiting requests that may be admitted now, in the order to try them. Forms a batch when due."""
        if self.name == "continuous":
            return iter(waiting)
        self.batch = [request for request in self.batch if not request.is_finished]
        if not self.batch and self._batch_due(waiting, now):
            self.batch = waiting.first(self.max_batch_size)
        return [request for request in self.batch if request.request_id in waiting]

    def batch_due_time(self, waiting: WaitingQueue) -> float | None:
        """dynamic: when the window of the oldest waiting request closes, if a batch is still to form."""
        if self.name != "dynamic" or any(not request.is_finished for request in self.batch):
            return None
        oldest = waiting.oldest_arrival_time()
        return None if oldest is None else oldest + self.batch_window_s

    def in_batch(self, request: Request) -> bool:
        return any(member is request for member in self.batch)

    def _batch_due(self, waiting: WaitingQueue, now: float) -> bool:
        if not waiting:
            return False
        if len(waiting) >= self.max_batch_size:
            return True
        if self.name == "dynamic":
            oldest = waiting.oldest_arrival_time()
            assert oldest is not None
            return now - oldest >= self.batch_window_s
        return self.input_ended

    def has_candidates(self, waiting: WaitingQueue, now: float) -> bool:
        """Whether candidates(waiting, now) would name anyone; no side effects (the engine thread asks this to
        decide between stepping and sleeping)."""
        if self.name == "continuous":
            return bool(waiting)
        members = [request for request in self.batch if not request.is_finished]
        if members:
            return any(request.request_id in waiting for request in members)
        return self._batch_due(waiting, now)
