"""The consumer side of the worker: fetch by priority, decode, check, queue locally or answer at once; measure
lag, apply load decisions (pause/resume, shed), commit behind the watermark, and keep the partition state
that rebalances change.

Attempt numbers. A record's `attempt` is the consumer group's generation id when this worker fetched it.
Kafka bumps the generation on every rebalance, and a record is only ever redelivered after a rebalance
(its owner died, left or lost its partitions) or after a restart (which rejoins the group, again a new
generation; the group keeps its generation while it has committed offsets). So a redelivered request always
carries a strictly higher attempt than every earlier delivery, without any extra state or topic. The first
attempt is therefore not 0 but the generation at that time: clients compare attempts, never expect 0.

Fetch order. Each poll asks the most urgent priority's partitions first (getmany per priority, a shared
max_poll_records budget), and fetches nothing while the local queue holds max_waiting requests, except from
partitions being shed (their records are answered, never queued), so the local queue stays below
max_waiting + max_poll_records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas.decode import RequestError, decode_request
from schemas.limits import Limits
from schemas.priority import priority_of_partition
from worker.engine.api import EngineStats
from worker.transport.admission import Admission, Verdict, estimate_prompt_tokens, estimate_service_s
from worker.transport.answers import Answers
from worker.transport.load_control import LoadDecision
from worker.transport.local_queue import LocalQueue, QueuedRequest
from worker.transport.offsets import OffsetTracker
from worker.transport.shedding import CompletionRate

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self, consumer: AIOKafkaConsumer, tracker: OffsetTracker, queue: LocalQueue, answers: Answers,
        admission: Admission, rate: CompletionRate, engine_stats: Callable[[], EngineStats], *,
        num_priorities: int, num_partitions: int, result_topic: str, max_poll_records: int, limits: Limits,
    ) -> None:
        self.consumer = consumer
        self.tracker = tracker
        self.queue = queue
        self.answers = answers
        self.admission = admission
        self.rate = rate
        self.engine_stats = engine_stats
        self.num_priorities = num_priorities
        self.num_partitions = num_partitions
        self.result_topic = result_topic
        self.max_poll_records = max_poll_records
        self.limits = limits
        self.assigned: set[TopicPartition] = set()
        self.paused: set[TopicPartition] = set()
        self.group_generation = -1
        self.load: LoadDecision | None = None
        """The last load decision applied: which priorities are shed, and why."""
        self.fetching_stopped = False

    # -- partitions ----------------------------------------------------------------------------------------
    def priority_of(self, tp: TopicPartition) -> int:
        return priority_of_partition(tp.partition, self.num_partitions, self.num_priorities)

    def partitions_of(self, priority: int) -> list[TopicPartition]:
        return sorted(tp for tp in self.assigned if self.priority_of(tp) == priority)

    def paused_by_priority(self) -> list[list[int]]:
        paused: list[list[int]] = [[] for _ in range(self.num_priorities)]
        for tp in self.paused:
            paused[self.priority_of(tp)].append(tp.partition)
        return paused

    def on_assigned(self, assigned: set[TopicPartition], group_generation: int) -> None:
        self.assigned = assigned
        self.paused &= assigned
        self.group_generation = group_generation
        for tp in assigned:
            self.tracker.revoke(tp)  # start clean: watermark state is created at the first record fetched
        log.info("assigned %s (generation %d)", sorted(tp.partition for tp in assigned), group_generation)

    def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Forget the revoked partitions' queued requests and watermarks (commit them first)."""
        self.queue.drop_partitions(revoked)
        for tp in revoked:
            self.tracker.revoke(tp)
        self.assigned -= revoked
        self.paused -= revoked

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        offsets = {tp: o for tp, o in self.tracker.to_commit().items()
                   if tp in self.assigned and (partitions is None or tp in partitions)}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.tracker.committed(offsets)
        except (KafkaError, AssertionError) as exc:
            log.warning("commit failed (%r); retrying at the next interval", exc)

    # -- fetching ------------------------------------------------------------------------------------------
    async def fetch_once(self) -> None:
        room = self.queue.max_waiting - len(self.queue)
        shed = self.load.shed_priorities if self.load else frozenset()
        budget = self.max_poll_records
        priorities = range(self.num_priorities) if room > 0 else sorted(shed)
        # (partition, records, generation when getmany returned them): the generation read after the call,
        # since a rebalance inside getmany resets positions and the records then belong to the new one.
        batches: list[tuple[TopicPartition, list, int]] = []
        for priority in priorities:
            parts = [tp for tp in self.partitions_of(priority) if tp not in self.paused]
            if parts and budget > 0:
                got = await self.consumer.getmany(*parts, timeout_ms=0, max_records=budget)
                for tp, msgs in got.items():
                    batches.append((tp, msgs, self.group_generation))
                    budget -= len(msgs)
        if not batches:
            if room <= 0:
                try:
                    await asyncio.wait_for(self.queue.space.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                return
            got = await self.consumer.getmany(timeout_ms=50, max_records=budget)
            batches = [(tp, msgs, self.group_generation) for tp, msgs in
                       sorted(got.items(), key=lambda item: self.priority_of(item[0]))]
        for tp, msgs, generation in batches:
            for msg in msgs:
                if self.group_generation != generation or tp not in self.assigned:
                    # A rebalance happened while we handled earlier records. The watermark is below these
                    # untracked records, and the partition's next owner (maybe us) reads them again.
                    break
                self.handle(tp, msg, generation)

    def handle(self, tp: TopicPartition, msg, attempt: int) -> None:
        """Decode one record, then answer it at once (error, rejection) or queue it locally. Never raises for
        bad input: schemas.decode turns any bytes into a request or a RequestError."""
        if not self.tracker.track(tp, msg.offset):
            return
        decoded = decode_request(msg.value, self.limits)
        if isinstance(decoded, RequestError):
            self.answers.dead_letter(tp, msg, decoded, attempt)
            return
        req = decoded
        priority = self.priority_of(tp)
        queued = QueuedRequest(
            request=req, partition=tp, offset=msg.offset, priority=priority, attempt=attempt,
            timestamp_ms=msg.timestamp, deadline_ms=req.deadline_at_ms(msg.timestamp),
            reply_topic=req.reply_topic or self.result_topic,
            num_prompt_tokens=estimate_prompt_tokens(req.prompt, req.messages, req.prompt_token_ids),
        )
        verdict = self.admission.check_reply_topic(req.reply_topic)
        if verdict is not None:
            # An error about the reply topic goes to the result topic: never write where we may not.
            self.answers.reject(tp, msg.offset, req.id, attempt, verdict, self.result_topic, msg.timestamp,
                                req.metadata)
            return
        if self.load is not None and priority in self.load.shed_priorities:
            self.answers.shed(queued, self.load.shed_message(priority))
            return
        verdict = self._check_deadline(queued)
        if verdict is not None:
            self.answers.reject_queued(queued, verdict)
            return
        self.queue.push(queued)

    def _check_deadline(self, queued: QueuedRequest) -> Verdict | None:
        ahead = sum(self.queue.num_waiting(q) for q in range(queued.priority + 1))
        est_service = estimate_service_s(self.engine_stats(), queued.num_prompt_tokens, queued.request.max_new_tokens)
        return self.admission.check_deadline(queued.deadline_ms, time.time() * 1000.0, self.rate.estimate_s(ahead),
                                             est_service)

    # -- load ----------------------------------------------------------------------------------------------
    async def lag_by_priority(self) -> list[int]:
        """Per priority: fetch high watermark (from the last fetch response, so no request) minus the next
        offset this worker will read, over its assigned partitions."""
        lag = [0] * self.num_priorities
        for tp in sorted(self.assigned):
            lag[self.priority_of(tp)] += await self._partition_lag(tp)
        return lag

    async def _partition_lag(self, tp: TopicPartition) -> int:
        try:
            highwater = self.consumer.highwater(tp)
        except AssertionError:  # revoked between listing and asking
            return 0
        if highwater is None:
            return 0
        position = self.tracker.next_offset(tp)
        if position is None:
            try:
                position = await asyncio.wait_for(self.consumer.position(tp), 0.05)
            except Exception:  # noqa: BLE001 - no valid position yet (just assigned): no lag known
                return 0
        return max(0, highwater - position)

    def apply(self, decision: LoadDecision) -> None:
        """Answer the waiting requests of newly shed priorities; pause and resume partitions as decided."""
        self.load = decision
        for priority in sorted(decision.newly_shed, reverse=True):
            for queued in self.queue.pop_all(priority):
                self.answers.shed(queued, decision.shed_message(priority))
        if not self.fetching_stopped:
            self._set_paused({tp for tp in self.assigned if self.priority_of(tp) in decision.pause_reasons},
                             decision.pause_reasons)

    def _set_paused(self, want: set[TopicPartition], reasons: dict[int, str]) -> None:
        to_pause, to_resume = want - self.paused, self.paused - want
        try:
            if to_pause:
                self.consumer.pause(*to_pause)
                log.info("paused %s (%s)", sorted(tp.partition for tp in to_pause), reasons)
            if to_resume:
                self.consumer.resume(*to_resume)
                log.info("resumed %s", sorted(tp.partition for tp in to_resume))
        except Exception:  # noqa: BLE001 - e.g. a partition revoked in between; the next tick retries
            log.debug("pause/resume failed", exc_info=True)
            return
        self.paused = set(want)

    def stop_fetching(self) -> None:
        """At shutdown: pause every partition and leave them paused."""
        self.fetching_stopped = True
        if self.assigned:
            try:
                self.consumer.pause(*self.assigned)
            except Exception:  # noqa: BLE001
                log.debug("pause at shutdown failed", exc_info=True)
