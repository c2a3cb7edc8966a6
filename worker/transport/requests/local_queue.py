"""The worker's local queue: decoded, admitted requests waiting to enter the engine; per priority, one FIFO
per tenant.

Here a request can still be shed, rejected on its deadline or overtaken by a more urgent one; the engine
sees it only when the dispatcher (dispatcher.py) moves it in. Within a priority, the next request is the head
of the tenant with the smallest virtual token counter (load/tenants.py: fair share); with one tenant that is
plain first come, first served. Pure: partitions are opaque hashable keys.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from schemas.request import GenerationRequest
from worker.transport.load.tenants import DEFAULT_TENANT, FairShare
from worker.transport.requests.stages import Stage


def resumable(request: GenerationRequest) -> bool:
    """Whether a later attempt may continue this request's output: not when it asks for logprobs (a progress
    record does not carry them) or ranks best_of completions by them."""
    return not request.sampling.logprobs and request.num_completions == request.n


class Untraced:
    """The trace of a request whose record started none (tracing off, or not sampled): records nothing."""

    __slots__ = ()

    def engine_done(self, out) -> None:
        pass


UNTRACED = Untraced()


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
    trace: object = UNTRACED
    """A tracing.RequestTrace when its record carried a sampled traceparent and tracing is on."""
    tenant: str = DEFAULT_TENANT
    """The request's tenant ("" when it names none)."""
    charged_tokens: float = 0.0
    """Tokens charged to its tenant's counter and quota when it entered the engine (corrected at its end)."""
    fair_tag: float = 0.0
    """Its tenant's counter when it entered the engine (api.EngineRequest.fair_tag)."""
    read_ms: float = 0.0
    """When this worker read its record (epoch ms; 0: not known)."""
    dispatched_ms: float = 0.0
    """When it was handed to the engine (epoch ms; 0: not yet)."""
    resume: object | None = None
    """A schemas.progress.ProgressRecord: an earlier attempt delivered this much of its output, and this one
    continues from there (its streams go on at that seq, the engine after those tokens)."""
    stage: Stage = Stage.READ
    """Where it is in its lifecycle (stages.py); moved by the lifecycle (lifecycle.py) only."""

    def resumed(self, index: int):
        """The CompletionProgress of completion `index` to continue from, or None."""
        if self.resume is None:
            return None
        return next((c for c in self.resume.completions if c.index == index), None)

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
    """Per priority, per tenant FIFOs, with a `space` event that is set whenever fewer than `max_waiting`
    requests wait. `fair` picks among the tenants of a priority; without it (or with one tenant) each priority
    is one FIFO in push order."""

    def __init__(self, num_priorities: int, max_waiting: int, fair: FairShare | None = None) -> None:
        self.max_waiting = max_waiting
        self.fair = fair if fair is not None else FairShare(num_priorities)
        self._by_priority: list[dict[str, deque[QueuedRequest]]] = [{} for _ in range(num_priorities)]
        self._num = [0] * num_priorities
        self._tokens = [0.0] * num_priorities
        self._tenant_tokens: list[dict[str, float]] = [{} for _ in range(num_priorities)]
        self._next: list[str | None] = [None] * num_priorities
        """The tenant head() chose, until a request of that priority leaves or a tenant joins: dispatching charges
        the counters, so the next pick may differ (a pick walks every waiting tenant of the priority)."""
        self._last_head: QueuedRequest | None = None
        self.space = asyncio.Event()
        self.space.set()
        self.max_num_waiting_seen = 0

    def __len__(self) -> int:
        return sum(self._num)

    def num_waiting(self, priority: int) -> int:
        return self._num[priority]

    def num_waiting_by_priority(self) -> list[int]:
        return list(self._num)

    def tokens_by_priority(self) -> list[float]:
        """Per priority, the expected tokens of the requests waiting (QueuedRequest.expected_tokens)."""
        return [max(0.0, t) for t in self._tokens]

    def num_waiting_by_tenant(self) -> dict[str, int]:
        """Requests waiting per tenant, all priorities together."""
        counts: dict[str, int] = {}
        for fifos in self._by_priority:
            for tenant, fifo in fifos.items():
                counts[tenant] = counts.get(tenant, 0) + len(fifo)
        return counts

    def tenants(self, priority: int) -> list[str]:
        """Tenants with requests waiting at this priority."""
        return list(self._by_priority[priority])

    def tenant_tokens(self, priority: int) -> dict[str, float]:
        return {t: max(0.0, v) for t, v in self._tenant_tokens[priority].items()}

    def tokens_ahead(self, priority: int, tenant: str, own_tokens: float) -> float:
        """Expected tokens served before a new request of `tenant` (of `own_tokens`) at `priority` would be done
        under fair share: all of the more urgent priorities' and, of its own priority, each tenant's queued
        tokens up to what its own tenant queues plus its own (fair queueing serves the others' in step with
        it); with one tenant, everything queued."""
        ahead = sum(self._tokens[:priority])
        mine = max(0.0, self._tenant_tokens[priority].get(tenant, 0.0)) + own_tokens
        for other, tokens in self._tenant_tokens[priority].items():
            ahead += max(0.0, tokens) if other == tenant else min(max(0.0, tokens), mine)
        return ahead

    def push(self, queued: QueuedRequest) -> None:
        priority, tenant = queued.priority, queued.tenant
        fifos = self._by_priority[priority]
        fifo = fifos.get(tenant)
        if fifo is None:
            self.fair.lift(priority, tenant, fifos)
            fifo = fifos[tenant] = deque()
            self._next[priority] = None
        fifo.append(queued)
        self._add(queued, 1)
        self.max_num_waiting_seen = max(self.max_num_waiting_seen, len(self))
        if len(self) >= self.max_waiting:
            self.space.clear()

    def head(self, priority: int, may_start: Callable[[QueuedRequest], bool] | None = None) -> QueuedRequest | None:
        """The request that enters the engine next at this priority: the head of the tenant with the smallest
        counter among those whose head `may_start` (quotas deferring a tenant say no); None when none waits or
        none may start."""
        fifos = self._by_priority[priority]
        if not fifos:
            return None
        tenant = self._next[priority]
        if tenant is not None and may_start is not None and not may_start(fifos[tenant][0]):
            tenant = None
        if tenant is None:
            ready = [t for t, fifo in fifos.items() if may_start is None or may_start(fifo[0])]
            if not ready:
                self._next[priority] = None
                return None
            tenant = ready[0] if len(ready) == 1 else self.fair.pick(priority, ready)
            # Cached only without a filter: a filtered pick may change with the time alone.
            self._next[priority] = tenant if may_start is None else None
        self._last_head = fifos[tenant][0]
        return self._last_head

    def pop(self, priority: int) -> QueuedRequest:
        """Remove the request the last head(priority) returned (or, if it is gone, the unfiltered head)."""
        queued = self._last_head
        if queued is None or queued.priority != priority or not self._holds(queued):
            queued = self.head(priority)
        self._last_head = None
        assert queued is not None, priority
        self._next[priority] = None
        self._remove_from_fifo(queued, self._by_priority[priority][queued.tenant].popleft)
        self._note_space()
        return queued

    def pop_newest(self, priority: int, tenant: str) -> QueuedRequest:
        """Remove the tenant's newest request at this priority (the one that would wait longest)."""
        queued = self._by_priority[priority][tenant][-1]
        self._remove_from_fifo(queued, self._by_priority[priority][tenant].pop)
        self._note_space()
        return queued

    def pop_all(self, priority: int, keep: Callable[[str], bool] = lambda tenant: False) -> list[QueuedRequest]:
        """Remove and return the requests of this priority, but those of tenants `keep` names."""
        taken = [q for tenant, fifo in self._by_priority[priority].items() if not keep(tenant) for q in fifo]
        self._drop(priority, lambda q: not keep(q.tenant))
        return taken

    def heaviest_tenant(self, priority: int) -> str | None:
        """The tenant with the most expected tokens waiting at this priority (per unit of weight)."""
        tokens = self._tenant_tokens[priority]
        if not tokens:
            return None
        return max(tokens, key=lambda t: tokens[t] / self.fair.weight(t))

    def take_partitions(self, partitions: set) -> list[QueuedRequest]:
        """Remove and return the requests of these partitions, in queue order per priority."""
        return self.take_where(lambda q: q.partition in partitions)

    def take_where(self, predicate: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        """Remove and return the requests that match (cancelled ones), in queue order per priority."""
        taken: list[QueuedRequest] = []
        for priority in range(len(self._by_priority)):
            matched = [q for q in self._iter_priority(priority) if predicate(q)]
            if matched:
                taken += matched
                self._drop(priority, predicate)
        return taken

    def restore(self, requests: list[QueuedRequest]) -> None:
        """Put requests taken by take_partitions back at the front of their queues, in their order."""
        for queued in reversed(requests):
            fifos = self._by_priority[queued.priority]
            if queued.tenant not in fifos:
                self.fair.lift(queued.priority, queued.tenant, fifos)
                fifos[queued.tenant] = deque()
            fifos[queued.tenant].appendleft(queued)
            self._add(queued, 1)
            self._next[queued.priority] = None
        if len(self) >= self.max_waiting:
            self.space.clear()

    def __iter__(self) -> Iterator[QueuedRequest]:
        for priority in range(len(self._by_priority)):
            yield from self._iter_priority(priority)

    def _holds(self, queued: QueuedRequest) -> bool:
        fifo = self._by_priority[queued.priority].get(queued.tenant)
        return fifo is not None and bool(fifo) and fifo[0] is queued

    def _iter_priority(self, priority: int) -> Iterator[QueuedRequest]:
        for fifo in self._by_priority[priority].values():
            yield from fifo

    def _add(self, queued: QueuedRequest, sign: int) -> None:
        priority = queued.priority
        self._num[priority] += sign
        self._tokens[priority] += sign * queued.expected_tokens
        tenant_tokens = self._tenant_tokens[priority]
        tenant_tokens[queued.tenant] = tenant_tokens.get(queued.tenant, 0.0) + sign * queued.expected_tokens

    def _remove_from_fifo(self, queued: QueuedRequest, take: Callable[[], QueuedRequest]) -> None:
        priority, tenant = queued.priority, queued.tenant
        taken = take()
        assert taken is queued
        self._add(queued, -1)
        fifos = self._by_priority[priority]
        if not fifos[tenant]:
            del fifos[tenant]
            del self._tenant_tokens[priority][tenant]
            self._next[priority] = None

    def _drop(self, priority: int, predicate: Callable[[QueuedRequest], bool]) -> None:
        fifos = self._by_priority[priority]
        for tenant in list(fifos):
            kept = [q for q in fifos[tenant] if not predicate(q)]
            if len(kept) == len(fifos[tenant]):
                continue
            for q in fifos[tenant]:
                if predicate(q):
                    self._add(q, -1)
            if kept:
                fifos[tenant] = deque(kept)
            else:
                del fifos[tenant]
                self._tenant_tokens[priority].pop(tenant, None)
        self._next[priority] = None
        self._note_space()

    def _note_space(self) -> None:
        if len(self) < self.max_waiting:
            self.space.set()
