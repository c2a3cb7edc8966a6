"""One owner for every request this worker reads, from its read to its end (stages.py draws the stages).

The parts around it each do one thing and ask it for the rest: the intake reads and decodes records and
hands each request here (`arrive`); the dispatcher decides when the engine has room and hands the next
request here (`enter`); the streamer turns engine outputs into chunks and finals; `Answers` writes every
final. What happens to a request is decided here, and only here:

- at its read: the reply topic, its cancel, shedding, its deadline, its tenant's quota, room in the queue;
- before the engine: its cancel, its deadline (it may have passed while it waited);
- a cancel record: wherever the request is (docs/delivery.md, "Cancellation");
- a load decision that sheds a priority: its waiting requests;
- a rebalance: its waiting requests are held, then put back or given up with their streams.

Every way out is a transition of the request's stage through the RequestBook, and every answer goes through
`Answers`, which refuses a second one. Cancel and deadline each have one method here (`cancel_of`,
`deadline_verdict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.engine.api import EngineRequest, fair_preempts
from worker.transport.load.admission import Admission, Verdict
from worker.transport.load.load_control import LoadDecision
from worker.transport.load.service_model import ServiceModel
from worker.transport.load.tenant_book import TenantBook
from worker.transport.requests.answers import Answers
from worker.transport.requests.cancels import Cancel, CancelledIds
from worker.transport.requests.engine_client import EngineClient
from worker.transport.requests.local_queue import LocalQueue, QueuedRequest
from worker.transport.requests.stages import RequestBook, Stage
from worker.transport.requests.streamer import Streamer


class Lifecycle:
    def __init__(self, book: RequestBook, queue: LocalQueue, streamer: Streamer, engine: EngineClient,
                 answers: Answers, admission: Admission, service: ServiceModel, tenants: TenantBook,
                 cancels: CancelledIds, result_topic: str) -> None:
        self.book, self.queue, self.streamer, self.engine = book, queue, streamer, engine
        self.answers, self.admission, self.service, self.tenants = answers, admission, service, tenants
        self.cancels = cancels
        self.result_topic = result_topic
        self.load: LoadDecision | None = None
        """The last load decision: which priorities are shed, and why."""
        self._held: list[QueuedRequest] = []
        """Waiting requests of partitions revoked in the rebalance under way, in queue order."""

    # -- read ----------------------------------------------------------------------------------------------
    def arrive(self, queued: QueuedRequest) -> str:
        """A request just read: answered at once, or queued. Returns "queued", "invalid" (refused for what it
        is), "load" (shed, deadline, quota) or "cancelled" (its cancel came first)."""
        self.book.read(queued)
        verdict = self.admission.check_reply_topic(queued.request.reply_topic)
        if verdict is not None:
            # An error about the reply topic goes to the result topic: never write where we may not.
            self.answers.reject_queued(queued, verdict, topic=self.result_topic)
            return "invalid"
        if self._cancelled(queued, "before it ran"):  # its cancel came first (or it is redelivered after one)
            return "cancelled"
        req, priority = queued.request, queued.priority
        queued.expected_tokens = self.service.expected_cost(queued.num_prompt_tokens, req.max_new_tokens,
                                                            req.num_completions)
        self.service.observe_read(priority, queued.num_prompt_tokens, req.max_new_tokens, req.num_completions)
        now = time.monotonic()
        self.tenants.note_read(priority, queued.tenant, queued.expected_tokens, now)
        if queued.resume is not None:
            # Its stream is under way: shedding it or its deadline now would waste what was delivered.
            self._queue(queued)
            return "queued"
        if (self.load is not None and priority in self.load.shed_priorities
                and self.tenants.fair.over_share(priority, queued.tenant, now)):
            self.answers.shed(queued, self.load.shed_message(priority))
            return "load"
        verdict = (self.deadline_verdict(queued, at_read=True)
                   or self.tenants.check_quota(queued.tenant, queued.expected_tokens, now))
        if verdict is not None:
            self.answers.reject_queued(queued, verdict)
            return "load"
        if not self._make_room(queued, now):
            return "load"
        self._queue(queued)
        return "queued"

    def _queue(self, queued: QueuedRequest) -> None:
        self.book.move(queued, Stage.QUEUED)
        self.queue.push(queued)

    def overflow_priorities(self, now: float) -> frozenset[int]:
        """Priorities read on while their local queue is full: contended by two or more tenants (FairShare.
        contended) and not filled by more urgent requests. Reading stops on a full queue to leave the rest in
        Kafka, but Kafka keeps a priority's records in arrival order: a tenant's flood ahead would then hold
        the others' records there. Read on, the newest request of the tenant holding most of the queue is shed
        instead (_make_room)."""
        fair = self.queue.fair
        waiting, ahead, overflow = self.queue.num_waiting_by_priority(), 0, []
        for priority in range(len(waiting)):
            if ahead < self.queue.max_waiting and fair.contended(priority, now):
                overflow.append(priority)
            ahead += waiting[priority]
        return frozenset(overflow)

    def _make_room(self, queued: QueuedRequest, now: float) -> bool:
        """Whether `queued` may join the local queue: there is room, or its priority overflows and the tenant
        holding most of its queue (over its share) gives up its newest request for it; False when that tenant is
        its own, and it is shed instead."""
        priority = queued.priority
        if sum(self.queue.num_waiting_by_priority()[:priority + 1]) < self.queue.max_waiting:
            return True
        if priority not in self.overflow_priorities(now):
            return True  # the fetch rule stops reading; the rest of this poll still joins
        heaviest = self.queue.heaviest_tenant(priority)
        tokens = self.queue.tenant_tokens(priority)
        weight = self.queue.fair.weight
        if heaviest is None or heaviest == queued.tenant or (
                (tokens.get(queued.tenant, 0.0) + queued.expected_tokens) / weight(queued.tenant)
                >= tokens[heaviest] / weight(heaviest)):
            self._shed_over_share(queued, now)
            return False
        self._shed_over_share(self.queue.pop_newest(priority, heaviest), now)
        return True

    def _shed_over_share(self, queued: QueuedRequest, now: float) -> None:
        self.tenants.dropped(queued.tenant, queued.expected_tokens, now)
        self.answers.shed(queued, f"tenant {queued.tenant or '(none)'!r} holds the most of priority "
                                  f"{queued.priority}'s full queue while other tenants wait (over its fair share)")

    # -- the deadline, decided here only -------------------------------------------------------------------
    def deadline_verdict(self, queued: QueuedRequest, at_read: bool = False) -> Verdict | None:
        """Whether the request can still finish before its deadline, with admission's margin: `at_read`, after
        the predicted wait behind what is queued and running ahead of it (the prediction is kept on the request
        and reported in its final, deadline or not); at the head of its queue, on its own service from now."""
        if queued.deadline_ms is None and not at_read:
            return None
        now_ms = time.time() * 1000.0
        if at_read:
            # Fair share serves the other tenants' queued tokens in step with its own: only up to as many count.
            ahead = (self.queue.tokens_ahead(queued.priority, queued.tenant, queued.expected_tokens)
                     + self.service.engine_tokens_ahead(queued.priority))
            num_ahead = sum(self.queue.num_waiting(q) for q in range(queued.priority + 1))
            wait = self.service.wait_s(ahead)
            service = self.service.service_for(queued, self.service.num_sharing(num_ahead))
            queued.predicted_queue_ms = max(0.0, now_ms - queued.timestamp_ms) + (wait or 0.0) * 1000.0
            queued.predicted_e2e_ms = queued.predicted_queue_ms + service * 1000.0
            return self.admission.check_deadline(queued.deadline_ms, now_ms, wait, service, queued.priority)
        if now_ms >= queued.deadline_ms:
            return Verdict("rejected", "deadline", "deadline passed while waiting in the local queue")
        service = self.service.service_for(queued, self.service.num_sharing())
        return self.admission.check_deadline(queued.deadline_ms, now_ms, 0.0, service, queued.priority)

    # -- into the engine -----------------------------------------------------------------------------------
    def ended_before_engine(self, queued: QueuedRequest) -> bool:
        """The head of its priority's queue, about to enter the engine: True, and it is taken out and answered,
        when its cancel is known or its deadline can no longer be met."""
        if self._cancelled(queued, "before it ran", from_queue=True):  # normally taken out when the cancel came
            return True
        verdict = self.deadline_verdict(queued)
        if verdict is None:
            return False
        self.queue.pop(queued.priority)
        self.answers.reject_queued(queued, verdict)
        return True

    def enter(self, queued: QueuedRequest, requests: Callable[[QueuedRequest], list[EngineRequest]]) -> None:
        """The head of its priority's queue goes into the engine: its streams open, its tenant is charged, and
        its engine requests (`requests` of it, once charged) are added."""
        self.queue.pop(queued.priority)
        self.book.move(queued, Stage.IN_ENGINE)
        self.streamer.open(queued)
        queued.charged_tokens = queued.expected_tokens
        queued.fair_tag = self.tenants.dispatched(queued.priority, queued.tenant, queued.expected_tokens,
                                                  time.monotonic())
        queued.dispatched_ms = time.time() * 1000.0
        for request in requests(queued):
            self.engine.add(request)

    def fair_room(self, queued: QueuedRequest) -> bool:
        """Whether a request of another tenant at its priority, far above its share, is in the engine (the
        engine's scheduler would preempt it for this one)."""
        if not self.queue.fair.contended(queued.priority, time.monotonic()):
            return False
        probe = EngineRequest("", fair_tag=self.queue.fair.counter(queued.priority, queued.tenant),
                              tenant=queued.tenant)
        mine = [s.queued for s in self.streamer.streams.values() if s.queued.priority == queued.priority]
        tenants = [q.tenant for q in mine]
        return any(fair_preempts(probe, q, tenants) for q in mine)

    # -- the cancel, decided here only ---------------------------------------------------------------------
    def cancel_of(self, request_id: str) -> Cancel | None:
        """The live cancel of a wire request id, if any."""
        return self.cancels.get(request_id, time.time() * 1000.0)

    def _cancelled(self, queued: QueuedRequest, when: str, from_queue: bool = False) -> bool:
        cancel = self.cancel_of(queued.request.id)
        if cancel is None:
            return False
        if from_queue:
            self.queue.pop(queued.priority)
        self.answers.cancelled(queued, cancel.reason, when)
        return True

    def cancel_arrived(self, cancel: Cancel) -> None:
        """A cancel record was read: its request stops wherever it is here. Waiting: answered at once. In the
        engine: its streams are marked and the engine aborts them before its next step, which frees their KV
        blocks; the abort's output ends each `cancelled` with the text so far (streamer.py). Not here (not read
        yet, finished, another worker's): the id stays in CancelledIds for a request read later."""
        for queued in self.queue.take_where(lambda queued: queued.request.id == cancel.request_id):
            self.answers.cancelled(queued, cancel.reason, "while it waited in the local queue")
        self.engine.abort(self.streamer.cancel(cancel.request_id, cancel.reason))

    def _sweep_cancelled(self) -> None:
        """Answer every waiting request whose cancel is known (held ones come back without being looked at)."""
        for queued in self.queue.take_where(lambda queued: self.cancel_of(queued.request.id) is not None):
            cancel = self.cancel_of(queued.request.id)
            self.answers.cancelled(queued, cancel.reason if cancel else "", "while it waited in the local queue")

    # -- load ----------------------------------------------------------------------------------------------
    def apply(self, decision: LoadDecision) -> None:
        """A load decision: the waiting requests of newly shed priorities are answered, but those of tenants
        under their share (shedding falls on the others)."""
        self.load = decision
        now = time.monotonic()
        for priority in sorted(decision.newly_shed, reverse=True):
            for queued in self.queue.pop_all(
                    priority, keep=lambda tenant, p=priority: not self.queue.fair.over_share(p, tenant, now)):
                self.tenants.dropped(queued.tenant, queued.expected_tokens, now)
                self.answers.shed(queued, decision.shed_message(priority))

    # -- rebalances and shutdown ---------------------------------------------------------------------------
    def hold(self, partitions: set) -> None:
        """Revoked at the start of a rebalance: their waiting requests are set aside, their streams keep running
        unpublished, until the assignment says which partitions stay."""
        for queued in self.queue.take_partitions(partitions):
            self.book.move(queued, Stage.HELD)
            self._held.append(queued)
        self.streamer.hold(partitions)

    def settle(self, gone: set) -> list[str]:
        """The assignment that ends a rebalance: requests of held partitions not `gone` go on (the waiting ones
        back to the front of the queue, the streams publishing what they gathered); those of `gone` are given up
        (the next owner answers them). Returns the engine ids to abort."""
        back = []
        for queued in self._held:
            if queued.partition in gone:
                self.book.given_up(queued)
            else:
                self.book.move(queued, Stage.QUEUED)
                back.append(queued)
        self._held = []
        self.queue.restore(back)
        self.answers.forget(gone)
        ids = self.give_up(lambda queued: queued.partition in gone)
        self.streamer.release(set(self.streamer.held_partitions) - gone)
        self._sweep_cancelled()  # held requests cancelled meanwhile are back
        return ids

    def give_up(self, predicate: Callable[[QueuedRequest], bool]) -> list[str]:
        """Requests in the engine that match: nothing more of theirs is written here. Returns their engine ids
        (for the engine's abort)."""
        return self.streamer.close_where(predicate, self.book.given_up)
