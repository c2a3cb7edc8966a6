"""The request side of the Kafka loop: fetch by priority, decode, admit or answer, hand work to the engine,
commit behind the watermark, follow rebalances.

Attempt numbers. A record's `attempt` is the consumer group's generation id when this worker fetched it.
Kafka bumps the generation on every rebalance, and a record is only ever redelivered after a rebalance
(its owner died, left or lost its partitions) or after a restart (which rejoins the group, again a new
generation; the group keeps its generation while it has committed offsets). So a redelivered request always
carries a strictly higher attempt than every earlier delivery, without any extra state or topic. The first
attempt is therefore not 0 but the generation at that time: clients compare attempts, never expect 0.
(The generation is read from aiokafka's coordinator, which has no public accessor for it.)

Fetch order. Each poll asks the most urgent priority's partitions first (getmany per priority, a shared
max_poll_records budget), and fetches nothing while the local queue holds max_waiting requests, except from
partitions being shed (their records are answered, never queued), so the local queue stays below
max_waiting + max_poll_records.

Rebalance. On revocation the revoked partitions' safe offsets are committed, their requests are aborted in
the engine and dropped from the local queue, and nothing more is published for them; the new owner serves
them again under a higher attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from schemas.dead_letter import DeadLetterRecord
from schemas.decode import RequestError, decode_request, encode
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.priority import priority_of_partition
from worker.config import KafkaSettings, WorkerSettings
from worker.transport.admission import Admission, Verdict, estimate_prompt_tokens, estimate_service_s
from worker.transport.assignor import PriorityRoundRobinAssignor
from worker.transport.results import Pending, answer_record

log = logging.getLogger(__name__)

MAX_DEAD_LETTER_VALUE = 512 * 1024
"""Bytes of an original record kept in its dead-letter record."""


class RebalanceListener(ConsumerRebalanceListener):
    def __init__(self, intake: "Intake") -> None:
        self.intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        await self.intake.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        self.intake.on_assigned(set(assigned))


def make_consumer(kafka: KafkaSettings, settings: WorkerSettings) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        **kafka.client_kwargs(),
        group_id=kafka.group_id,
        client_id=settings.worker_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        partition_assignment_strategy=(PriorityRoundRobinAssignor(kafka.num_priorities),),
        max_poll_records=settings.max_poll_records,
        session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=max(100, int(settings.session_timeout_s * 1000) // 4),
    )


class Intake:
    """Owned by the Worker (serve.py); the worker wires `engine_add`, `streamer`, `publisher` and `tracker`."""

    def __init__(self, worker, kafka: KafkaSettings, settings: WorkerSettings, limits: Limits = DEFAULT_LIMITS):
        self.w = worker
        self.kafka = kafka
        self.settings = settings
        self.limits = limits
        self.num_priorities = kafka.num_priorities
        self.num_partitions = kafka.num_request_partitions
        self.admission = Admission(kafka.result_topic, frozenset(kafka.allowed_reply_topics),
                                   list(settings.itl_target_ms), worker.max_num_batched_tokens)
        self.local: list[deque[Pending]] = [deque() for _ in range(self.num_priorities)]
        self.assigned: set[TopicPartition] = set()
        self.generation = -1
        self.shed_priorities: frozenset[int] = frozenset()
        self.paused: set[TopicPartition] = set()
        self.draining = False
        self.max_local_waiting_seen = 0
        self.num_dead_letters = 0
        self.space = asyncio.Event()

    # -- bookkeeping -------------------------------------------------------------------------------------
    @property
    def num_local_waiting(self) -> int:
        return sum(len(q) for q in self.local)

    def priority_of(self, tp: TopicPartition) -> int:
        return priority_of_partition(tp.partition, self.num_partitions, self.num_priorities)

    def partitions_of(self, priority: int) -> list[TopicPartition]:
        return sorted(tp for tp in self.assigned if self.priority_of(tp) == priority)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.assigned = assigned
        self.paused &= assigned
        self.generation = self.w.consumer._coordinator.generation
        for tp in assigned:
            self.w.tracker.revoke(tp)  # start clean: watermark state is created at the first record fetched
        log.info("assigned %s (generation %d)", sorted(tp.partition for tp in assigned), self.generation)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        if self.w.streamer is None:
            return  # the first join of a starting worker: nothing is owned yet
        await self.w.commit(revoked)
        ids = self.w.streamer.forget(lambda p: p.partition in revoked)
        self.w.engine.abort(ids)
        for queue in self.local:
            kept = [p for p in queue if p.partition not in revoked]
            queue.clear()
            queue.extend(kept)
        for tp in revoked:
            self.w.tracker.revoke(tp)
        self.assigned -= revoked
        self.paused -= revoked
        log.info("revoked %s; aborted %d in-flight requests", sorted(tp.partition for tp in revoked), len(ids))

    # -- fetching ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = 0.1
        while not self.w.stopping.is_set():
            try:
                await self.fetch_once()
                backoff = 0.1
            except KafkaError as exc:
                log.warning("fetch failed (%r); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad record or state
                log.exception("intake error; continuing")
                await asyncio.sleep(0.1)

    async def fetch_once(self) -> None:
        consumer = self.w.consumer
        room = self.settings.max_waiting - self.num_local_waiting
        budget = self.settings.max_poll_records
        if room > 0:
            groups = [self.partitions_of(p) for p in range(self.num_priorities)]
        else:
            groups = [self.partitions_of(p) for p in sorted(self.shed_priorities)]
        # (partition, records, generation when getmany returned them): the generation read after the call,
        # since a rebalance inside getmany resets positions and the records then belong to the new one.
        batches: list[tuple[TopicPartition, list, int]] = []
        for parts in groups:
            parts = [tp for tp in parts if tp not in self.paused]
            if parts and budget > 0:
                got = await consumer.getmany(*parts, timeout_ms=0, max_records=budget)
                for tp, msgs in got.items():
                    batches.append((tp, msgs, self.generation))
                    budget -= len(msgs)
        if not batches:
            if room <= 0:
                self.space.clear()
                try:
                    await asyncio.wait_for(self.space.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                return
            got = await consumer.getmany(timeout_ms=50, max_records=budget)
            batches = [(tp, msgs, self.generation) for tp, msgs in
                       sorted(got.items(), key=lambda item: self.priority_of(item[0]))]
        for tp, msgs, generation in batches:
            for msg in msgs:
                if self.generation != generation or tp not in self.assigned:
                    # A rebalance happened while we handled earlier records. The watermark is below these
                    # untracked records, and the partition's next owner (maybe us) reads them again.
                    break
                self.handle(tp, msg, generation)
        self.max_local_waiting_seen = max(self.max_local_waiting_seen, self.num_local_waiting)
        self.admit()
        await self.w.publisher.wait_room()

    def handle(self, tp: TopicPartition, msg, attempt: int) -> None:
        """Decode one record, then answer it at once (error, rejection) or queue it locally. Never raises for
        bad input: schemas.decode turns any bytes into a request or a RequestError."""
        if not self.w.tracker.track(tp, msg.offset):
            return
        done = lambda: self.w.record_done(tp, msg.offset)  # noqa: E731
        decoded = decode_request(msg.value, self.limits)
        if isinstance(decoded, RequestError):
            self._dead_letter(tp, msg, decoded, attempt, done)
            return
        req = decoded
        priority = self.priority_of(tp)
        verdict = self.admission.check_reply_topic(req.reply_topic)
        if verdict is None and priority in self.shed_priorities:
            self.w.metrics.shed_for(priority).inc()
            verdict = Verdict("rejected", "shed", self.w.shed_message(priority))
        num_prompt_tokens = estimate_prompt_tokens(req.prompt, req.messages, req.prompt_token_ids)
        deadline_ms = req.deadline_at_ms(msg.timestamp)
        if verdict is None:
            ahead = sum(len(self.local[q]) for q in range(priority + 1))
            est_service = estimate_service_s(self.w.engine.stats, num_prompt_tokens, req.max_new_tokens)
            verdict = self.admission.check_deadline(deadline_ms, time.time() * 1000.0,
                                                    self.w.rate.estimate_s(ahead), est_service)
        if verdict is not None:
            # An error about the reply topic goes to the result topic: never write where we may not.
            topic = self.kafka.result_topic if verdict.reason == "reply_topic_not_allowed" else (
                req.reply_topic or self.kafka.result_topic)
            self.answer(req.id, attempt, verdict, topic, msg.timestamp, req.metadata, done)
            return
        self.local[priority].append(Pending(
            request=req, partition=tp, offset=msg.offset, priority=priority, attempt=attempt,
            timestamp_ms=msg.timestamp, deadline_ms=deadline_ms, reply_topic=req.reply_topic or self.kafka.result_topic,
            num_prompt_tokens=num_prompt_tokens,
        ))

    def answer(self, request_id, attempt, verdict: Verdict, topic, timestamp_ms, metadata, done) -> None:
        record = answer_record(request_id, attempt, verdict.status, verdict.reason, verdict.message,
                               timestamp_ms, self.settings.worker_id, metadata)
        if verdict.reason != "shed":
            self.w.metrics.rejected_for(verdict.reason).inc()
        self.w.publisher.publish_nowait(topic, request_id.encode(), encode(record), done)

    def _dead_letter(self, tp, msg, error: RequestError, attempt: int, done) -> None:
        value = msg.value
        if value is not None and len(value) > MAX_DEAD_LETTER_VALUE:
            # Base64 grows it by a third: kept whole, a record near the broker's limit could not be set aside.
            value = value[:MAX_DEAD_LETTER_VALUE]
            error = RequestError(error.code, f"{error.message} [value truncated to {MAX_DEAD_LETTER_VALUE} of "
                                 f"{len(msg.value)} bytes]", error.request_id)
        dead = DeadLetterRecord(
            value=value, key=msg.key, error_code=error.code, error_message=error.message[:2000],
            request_id=error.request_id, topic=tp.topic, partition=tp.partition, offset=msg.offset,
            timestamp_ms=msg.timestamp, dead_lettered_ms=int(time.time() * 1000), worker_id=self.settings.worker_id,
        )
        records = [(self.kafka.dead_letter_topic, msg.key, encode(dead))]
        if error.request_id is not None:
            final = answer_record(error.request_id, attempt, "error", error.code, error.message[:2000],
                                  msg.timestamp, self.settings.worker_id)
            records.append((self.kafka.result_topic, error.request_id.encode(), encode(final)))
        self.num_dead_letters += 1
        self.w.metrics.dead_letters.inc()
        self.w.metrics.rejected_for(error.code).inc()
        self.w.publisher.publish_all_nowait(records, done)

    # -- into the engine ---------------------------------------------------------------------------------
    def admit(self) -> None:
        """Move requests from the local queue into the engine, most urgent first, within the in-flight cap."""
        streamer, engine = self.w.streamer, self.w.engine
        cap = self.w.max_engine_inflight
        inflight = streamer.inflight
        for priority, queue in enumerate(self.local):
            while queue and not self.draining and len(inflight) < cap:
                pending = queue[0]
                if pending.deadline_ms is not None and time.time() * 1000.0 >= pending.deadline_ms:
                    queue.popleft()
                    verdict = Verdict("rejected", "deadline", "deadline passed while waiting in the local queue")
                    self.answer(pending.request.id, pending.attempt, verdict, pending.reply_topic,
                                pending.timestamp_ms, pending.request.metadata,
                                lambda p=pending: self.w.record_done(p.partition, p.offset))
                    continue
                if not self.admission.may_enter_batch(priority, pending.num_prompt_tokens,
                                                      streamer.num_inflight_by_priority, engine.stats):
                    # Less urgent requests would slow the same urgent ones even more: hold them all.
                    return self._note_space()
                queue.popleft()
                engine.add(streamer.start(pending))
        self._note_space()

    def _note_space(self) -> None:
        if self.num_local_waiting < self.settings.max_waiting:
            self.space.set()

    def shed_local(self, priorities: frozenset[int]) -> None:
        """Answer the locally waiting requests of newly shed priorities."""
        for priority in sorted(priorities, reverse=True):
            while self.local[priority]:
                pending = self.local[priority].popleft()
                self.w.metrics.shed_for(priority).inc()
                verdict = Verdict("rejected", "shed", self.w.shed_message(priority))
                self.answer(pending.request.id, pending.attempt, verdict, pending.reply_topic,
                            pending.timestamp_ms, pending.request.metadata,
                            lambda p=pending: self.w.record_done(p.partition, p.offset))
