"""Exactly one visible final record per request: finals and the request offsets they answer, in one transaction.

Each request partition the worker owns has a lane: a transactional producer whose `transactional.id` is
derived from the group, the request topic and the partition. Every record that answers a request record of
that partition (its finals, and dead letters) goes into the lane; every `interval_s` the lane writes what it
gathered and the partition's new watermark (offsets.py) in one transaction and commits it. A consumer of the
results with `isolation.level=read_committed` sees a final only when its request's offset is committed with
it: a worker that dies before the commit leaves neither, and the request's next owner answers it once.

Zombies are fenced by the transactional id (KIP-98), not by the group generation: aiokafka sends offsets to a
transaction with TxnOffsetCommit v0, which carries no generation or member id (KIP-447). When a partition
moves, its new owner starts the lane's producer with the same id before it reads the partition's committed
offset (in the rebalance listener); the broker then aborts the old owner's open transaction and refuses
every later one of the old producer (ProducerFenced). A lane that is fenced never starts a producer again
on its own: only a new assignment does, so a zombie cannot fence the owner back.

Chunks stay outside transactions (the publisher sends them as soon as they are made). A read_committed
consumer still reads them in order with the final: a lane waits until the publisher has settled every record
published before the finals it is about to write, and a read_committed consumer never reads past an open
transaction on a partition, so it sees a stream's chunks at most a transaction interval late. A
read_uncommitted consumer sees chunks at once, and finals as soon as they are written, including those of a
transaction that is later aborted (a zombie's, or one that failed): it must keep deduplicating by attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (InvalidProducerEpoch, KafkaError, ProducerFenced, TopicAuthorizationFailedError,
                             TransactionalIdAuthorizationFailed)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from schemas.decode import encode
from schemas.result import FinalRecord
from worker.kafka_stop import stop_client
from worker.transport.kafka.aiokafka_compat import fail_unsent_batches, producer_is_dead
from worker.transport.kafka.destinations import DEFAULT_MAX_MESSAGE_BYTES, record_problem
from worker.transport.kafka import progress
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.kafka.publisher import Publisher, fill_batch

log = logging.getLogger(__name__)

ProgressSource = Callable[[TopicPartition, bool], list[tuple[bytes, bytes]]]
"""(partition, full round) -> (key, value) progress records: Streamer.progress_records."""

FIRST_RECORD_WAIT_S = 0.2
"""Longest a lane with nothing to answer waits before a transaction of its own carries the first progress records
of the streams that started since its last one."""
AnswerRecord = tuple[str, bytes | None, bytes, FinalRecord | None]
"""(topic, key, value, the final it encodes or None): one record that answers a request record."""
Replacement = Callable[[str, FinalRecord, str, str], tuple[str, FinalRecord] | None]
"""Answers.replacement: what goes instead of a final that its topic does not take, and where."""

FENCED = (ProducerFenced, InvalidProducerEpoch, TransactionalIdAuthorizationFailed)


class LaneStuck(Exception):
    """A transaction's records were not acknowledged in time."""


def _topics_named(exc: BaseException) -> set[str]:
    found: set[str] = set()
    for arg in exc.args:
        if isinstance(arg, str):
            found.add(arg)
        elif isinstance(arg, (set, frozenset, list, tuple)):
            found.update(t for t in arg if isinstance(t, str))
    return found


def transactional_id(group_id: str, partition: TopicPartition) -> str:
    """One id per request partition: whoever owns the partition owns the id, and starting it fences the rest."""
    return f"{group_id}.{partition.topic}.{partition.partition}"


@dataclass(slots=True)
class _Pending:
    offset: int | None
    records: list[AnswerRecord]


@dataclass(slots=True)
class Lane:
    partition: TopicPartition
    producer: AIOKafkaProducer | None = None
    pending: list[_Pending] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    fenced: bool = False
    writing: bool = False
    needs_new_producer: bool = False
    last_write_at: float = 0.0
    """time.monotonic() when the lane last began writing a transaction."""
    num_transactions: int = 0
    last_committed: int | None = None
    last_metadata: str = ""
    resume_from: int | None = None
    """Where the latest full round of the partition's progress records begins (progress topic offset): committed
    in the offset's metadata, so the next owner resumes the streams from there."""
    last_round_at: float = 0.0
    """time.monotonic() of the last full round of progress records."""
    progress: list[tuple[bytes, bytes]] = field(default_factory=list)
    """The progress records the next transaction writes (set by _progress_due)."""
    progress_full_round: bool = False
    round_digest: int = 0
    """Of the round the next transaction writes."""
    last_round_digest: int | None = None
    """Of the last full round committed: an unchanged round is not written again."""


class FinalLanes:
    """The lanes of the partitions this worker owns."""

    def __init__(self, client_kwargs: dict, group_id: str, tracker: OffsetTracker, publisher: Publisher,
                 replacement: Replacement, interval_s: float = 0.1, max_records: int = 500,
                 max_metadata_bytes: int = progress.DEFAULT_MAX_BYTES,
                 still_member: Callable[[], Awaitable[bool]] | None = None,
                 progress_topic: str = "", progress_source: ProgressSource | None = None,
                 progress_interval_s: float = 0.5) -> None:
        self._client_kwargs = client_kwargs
        self.group_id = group_id
        self.tracker = tracker
        self.publisher = publisher
        self.replacement = replacement
        self.interval_s = interval_s
        """A lane writes at most one transaction per interval: finals that come meanwhile wait for the next."""
        self.max_records = max_records
        """A lane writes at once when this many answers wait."""
        self.still_member = still_member
        """Whether this worker is still the group member that owns its partitions: asked before a lane starts a
        new producer on its own, which fences whoever holds the transactional id now."""
        self.max_metadata_bytes = max_metadata_bytes
        """The broker's offset.metadata.max.bytes: the progress metadata of a commit stays within it."""
        self.progress_topic = progress_topic
        self.progress_source = progress_source if progress_topic else None
        """The streamer's progress records of a partition (all of them, or only those never written): written
        in the partition's transactions so the next owner resumes its streams (schemas/progress.py)."""
        self.progress_interval_s = progress_interval_s
        """A full round of progress records at most this often; in between, only requests that have none yet."""
        self._lanes: dict[TopicPartition, Lane] = {}
        self.num_progress_records = 0
        self.num_progress_full = 0
        self.num_fenced = 0
        self.num_aborted = 0

    # -- ownership ----------------------------------------------------------------------------------------
    async def assign(self, partitions: set[TopicPartition]) -> None:
        """Start a lane for each newly owned partition; returns once each has fenced the previous owner (or
        failed to start its producer: its lane then keeps trying, and holds the partition's answers meanwhile).
        Call before the partitions' committed offsets are read (the rebalance listener)."""
        new = [tp for tp in partitions if tp not in self._lanes or self._lanes[tp].fenced]
        for tp in new:
            old = self._lanes.pop(tp, None)
            if old is not None:
                await self._close(old)
        lanes = [Lane(tp) for tp in new]
        for lane in lanes:
            self._lanes[lane.partition] = lane
        await asyncio.gather(*(self._ensure_producer(lane) for lane in lanes))
        for lane in lanes:
            lane.task = asyncio.create_task(self._run(lane), name=f"final-lane-{lane.partition.partition}")

    async def _ensure_producer(self, lane: Lane) -> bool:
        if lane.producer is not None:
            return True
        try:
            lane.producer = await self._start_producer(lane.partition)
            return True
        except FENCED:
            raise
        except Exception as exc:  # noqa: BLE001 - the broker away or slow: the lane tries again
            log.warning("cannot start the transactional producer of %s yet (%r); its answers wait", lane.partition,
                        exc)
            return False

    async def _start_producer(self, tp: TopicPartition) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(**self._client_kwargs, transactional_id=transactional_id(self.group_id, tp),
                                    enable_idempotence=True, acks="all", max_request_size=4 * 1024 * 1024)
        try:
            await asyncio.wait_for(producer.start(), 30.0)  # InitProducerId: fences the previous owner's producer
        except BaseException:
            await stop_client(producer, f"new lane producer of {tp}")
            raise
        return producer

    async def flush(self, partitions: set[TopicPartition] | None = None, timeout_s: float = 30.0) -> bool:
        """Write what the lanes of these partitions hold now (before giving them up, or at shutdown)."""
        lanes = [lane for tp, lane in self._lanes.items() if partitions is None or tp in partitions]
        deadline = time.monotonic() + timeout_s
        for lane in lanes:
            lane.wake.set()
        while any((lane.pending or lane.writing) and not lane.fenced for lane in lanes):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def revoke(self, partitions: set[TopicPartition]) -> None:
        """Close the lanes of partitions given up (their unwritten finals are dropped: the next owner answers)."""
        for tp in partitions:
            lane = self._lanes.pop(tp, None)
            if lane is not None:
                await self._close(lane)

    async def stop(self) -> None:
        await self.revoke(set(self._lanes))

    async def _close(self, lane: Lane) -> None:
        if lane.task is not None:
            lane.task.cancel()
            await asyncio.gather(lane.task, return_exceptions=True)
        if lane.producer is None:
            return
        # A fenced or broken producer may fail to stop; its connections are closed all the same.
        await stop_client(lane.producer, f"lane producer of {lane.partition}")

    def owned(self) -> set[TopicPartition]:
        return set(self._lanes)

    def fenced(self) -> set[TopicPartition]:
        """Partitions whose lane was fenced: another worker's producer took its transactional id since."""
        return {tp for tp, lane in self._lanes.items() if lane.fenced}

    def owns(self, partition: Hashable) -> bool:
        lane = self._lanes.get(partition)
        return lane is not None and not lane.fenced

    # -- the hot path -------------------------------------------------------------------------------------
    def add(self, partition: Hashable, offset: int | None, records: list[AnswerRecord]) -> None:
        lane = self._lanes.get(partition)
        if lane is None or lane.fenced:
            # Not ours (any more): the partition's owner answers the request, once; nothing of it is written here.
            log.debug("answer for %s@%s dropped: no lane (partition not owned)", partition, offset)
            return
        lane.pending.append(_Pending(offset, records))
        if len(lane.pending) == 1 or len(lane.pending) >= self.max_records:
            lane.wake.set()

    async def _run(self, lane: Lane) -> None:
        backoff = 0.1
        while True:
            while not await self._ensure_producer(lane):
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            if self.progress_source is None:
                await lane.wake.wait()
            else:  # progress is written even while no request of the partition ends
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as the event is
                # set, which is how a lane is closed after a flush woke it, and the lane would never end.
                waiter = asyncio.ensure_future(lane.wake.wait())
                try:
                    await asyncio.wait({waiter}, timeout=self.interval_s)
                finally:
                    waiter.cancel()
            # At most one transaction per interval and lane: under load each carries many finals; after a
            # quiet spell the first final goes at once instead of waiting out an interval alone.
            since_last = time.monotonic() - lane.last_write_at
            if since_last < self.interval_s and len(lane.pending) < self.max_records:
                await asyncio.sleep(self.interval_s - since_last)
            lane.wake.clear()
            if not self._progress_due(lane) and not lane.pending:
                continue
            batch, lane.pending = lane.pending, []
            lane.writing = True
            lane.last_write_at = time.monotonic()
            try:
                await self._write(lane, batch)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except FENCED as exc:
                self._fence(lane, batch, exc)
                return
            except Exception as exc:  # noqa: BLE001 - a broker away or a refused transaction: abort, write again
                self.num_aborted += 1
                if isinstance(exc, TopicAuthorizationFailedError):
                    # The next attempt replaces that topic's finals (an error final on the result topic).
                    for topic in _topics_named(exc):
                        self.publisher.destinations.mark_unavailable(topic, f"not authorized to WRITE topic {topic!r}")
                log.warning("transaction of %d answers for %s failed (%r); aborting and retrying in %.1fs",
                            sum(len(p.records) for p in batch), lane.partition, exc, backoff)
                try:
                    if isinstance(exc, LaneStuck) or lane.needs_new_producer or producer_is_dead(lane.producer):
                        lane.needs_new_producer = True
                        # A process that was frozen past its session timeout finds its transaction "stuck" as
                        # it wakes: a new producer would fence the partition's new owner and commit stale
                        # answers. Only a worker that is still the member that owned it replaces its producer.
                        if self.still_member is not None and not await self.still_member():
                            self._fence(lane, batch, LaneStuck("this worker is no longer the group member that "
                                                               "owned the partition"))
                            return
                        await self._replace_producer(lane)
                    else:
                        await self._abort(lane)
                except FENCED as fenced:
                    self._fence(lane, batch, fenced)
                    return
                except Exception:  # the broker away: the next attempt begins anew
                    log.debug("recovering the lane of %s failed", lane.partition, exc_info=True)
                # _write may already have put some of the batch back (answers whose chunks were not yet
                # settled): requeued twice they would be written, and committed, twice.
                requeued = {id(p) for p in lane.pending}
                lane.pending = [p for p in batch if id(p) not in requeued] + lane.pending
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                lane.wake.set()
            finally:
                lane.writing = False

    def _progress_due(self, lane: Lane) -> bool:
        """Whether the lane has progress records to write now: a full round when one is due and differs from the
        last; in between, the first records of requests that have none, in the next transaction that answers
        something, or in one of their own once FIRST_RECORD_WAIT_S passed since the lane's last (a transaction
        costs the broker several requests, so they wait a little to share one)."""
        lane.progress, lane.progress_full_round = [], False
        if self.progress_source is None:
            return False
        now = time.monotonic()
        full = now - lane.last_round_at >= self.progress_interval_s
        if not full:
            if lane.pending:
                lane.progress = self.progress_source(lane.partition, False)
                return False
            if now - lane.last_write_at >= FIRST_RECORD_WAIT_S:
                # Streams under way with none yet: a short request streams its whole output within one round,
                # and a kill before its first record makes the next owner start it over. Alone, at most every
                # FIRST_RECORD_WAIT_S a lane; under load they ride on transactions that answer something.
                lane.progress = self.progress_source(lane.partition, False)
                return bool(lane.progress)
            return False
        records = self.progress_source(lane.partition, True)
        digest = hash(tuple(records))
        if digest == lane.last_round_digest and not lane.pending:
            lane.last_round_at = time.monotonic()  # nothing moved: the last round still stands
            return False
        lane.progress, lane.progress_full_round, lane.round_digest = records, True, digest
        return bool(records) or lane.resume_from is not None

    def keep_resume_point(self, partition: TopicPartition, offset: int | None) -> None:
        """The previous owner's resume point, committed again until this worker's first round replaces it."""
        lane = self._lanes.get(partition)
        if lane is not None and lane.resume_from is None:
            lane.resume_from = offset

    def _fence(self, lane: Lane, batch: list[_Pending], exc: BaseException) -> None:
        lane.fenced = True
        self.num_fenced += 1
        log.warning("the finals of %s are fenced (%r): another worker owns the partition now; %d unwritten "
                    "answers dropped (the new owner answers them)", lane.partition, exc,
                    sum(len(p.records) for p in batch))

    async def _abort(self, lane: Lane) -> None:
        try:
            await asyncio.wait_for(lane.producer.abort_transaction(), 10.0)
        except FENCED:
            raise
        except Exception:  # not in a transaction, or the broker away: the next begin tells
            log.debug("abort of %s failed", lane.partition, exc_info=True)

    async def _write(self, lane: Lane, batch: list[_Pending]) -> None:
        # A request's chunks land before its final, so no reader sees a final before its stream's end: answers
        # whose chunks the publisher still holds wait for the next transaction (their offsets with them).
        unsettled = self.publisher.has_unsettled

        def chunks_pending(answers: list[_Pending]) -> list[_Pending]:
            return [p for p in answers if any(unsettled(key) for _, key, _, final in p.records if final is not None)]

        waiting = chunks_pending(batch)
        deadline = time.monotonic() + self.interval_s / 2
        while waiting and time.monotonic() < deadline:  # the last chunks are usually a send away
            await asyncio.sleep(0.002)
            waiting = chunks_pending(waiting)
        progress_records, full_round = lane.progress, lane.progress_full_round
        lane.progress, lane.progress_full_round = [], False
        if waiting:
            held = {id(p) for p in waiting}
            batch = [p for p in batch if id(p) not in held]
            lane.pending = waiting + lane.pending
            lane.wake.set()
            if not batch and not progress_records:
                await asyncio.sleep(self.interval_s)
                return
        if batch:
            batch = self._fit_progress(lane, batch)
            if not batch and not progress_records:
                await asyncio.sleep(self.interval_s)
                return
        records = [record for pending in batch for record in await self._deliverable(pending.records)]
        producer = lane.producer
        await producer.begin_transaction()
        try:
            # Bounded: a topic deleted since it was looked up holds its record forever (an idempotent producer
            # never expires a batch); the lane then looks its topics up again and starts a new producer.
            first_progress = await asyncio.wait_for(
                self._send_all(producer, records, self.publisher.headers_for, lane.partition.partition,
                               progress_records), self.publisher.send_wait_s)
        except asyncio.TimeoutError:
            for topic in {topic for topic, _, _ in records}:
                self.publisher.destinations.forget(topic)
            raise LaneStuck(f"records not acknowledged within {self.publisher.send_wait_s:g} s") from None
        resume_from = lane.resume_from
        if full_round:
            # Every request with something to resume is in this round (None: none has): the next owner needs
            # nothing older.
            resume_from = first_progress
        answered = frozenset(pending.offset for pending in batch if pending.offset is not None)
        # The watermark and, in its metadata, every offset above it whose answer is in the log (this
        # transaction's included): the partition's next owner starts at the one and skips the others.
        # Computed here, after the sends: records read meanwhile are pending, so never claimed.
        found = self.tracker.progress(lane.partition, answered)
        offsets = None
        if found is not None:
            mark, runs = found
            metadata = progress.encode(mark, runs, resume_from)
            if answered or lane.last_committed is None or mark != lane.last_committed \
                    or metadata != lane.last_metadata:
                offsets = {lane.partition: OffsetAndMetadata(mark, metadata)}
                await producer.send_offsets_to_transaction(offsets, self.group_id)
        await producer.commit_transaction()
        lane.num_transactions += 1
        self.num_progress_records += len(progress_records)
        if full_round:
            lane.last_round_at = time.monotonic()
            if found is not None:
                lane.resume_from = resume_from
                lane.last_round_digest = lane.round_digest
        # Only now are they done: a transaction that failed leaves them pending, to be written again.
        for offset in answered:
            self.tracker.done(lane.partition, offset)
        if offsets is not None:
            lane.last_committed, lane.last_metadata = mark, metadata
            self.tracker.committed({lane.partition: mark})
            state = self.tracker.state(lane.partition)
            if state is not None:
                state.progress_bytes = len(metadata)

    def _fit_progress(self, lane: Lane, batch: list[_Pending]) -> list[_Pending]:
        """The answers of `batch` whose offsets fit in the progress metadata with the rest; the others wait,
        and reading the partition stops (OffsetTracker.progress_full) until its watermark moves. The lowest
        answered offset always fits: answering the watermark's own request shortens the list."""
        tracker, tp, limit = self.tracker, lane.partition, self.max_metadata_bytes
        state = tracker.state(tp)
        offsets = sorted(p.offset for p in batch if p.offset is not None)
        if state is None or not offsets:
            return batch

        def fits(done: list[int]) -> bool:
            mark, runs = state.progress(frozenset(done))
            return progress.encoded_size(mark, runs) <= limit

        if fits(offsets):
            state.progress_full = False
            return batch
        taken: list[int] = []
        for offset in offsets:
            if fits([*taken, offset]):
                taken.append(offset)
        keep = set(taken)
        held = [p for p in batch if p.offset is not None and p.offset not in keep]
        state.progress_full = True
        self.num_progress_full += 1
        log.warning("the progress metadata of %s is full (%d bytes at most): %d answers wait for its watermark "
                    "(%d) to move, and reading the partition waits with them", tp, limit, len(held),
                    state.watermark())
        lane.pending = held + lane.pending
        lane.wake.set()
        return [p for p in batch if p.offset is None or p.offset in keep]

    async def _send_all(self, producer: AIOKafkaProducer, records: list[tuple[str, bytes | None, bytes]],
                        headers_for=None, progress_partition: int = 0,
                        progress_records: list[tuple[bytes, bytes]] = ()) -> int | None:
        """Batches built by hand, one or more per partition, as the publisher builds them (aiokafka's per-record
        send costs about 40 us more a record). `headers_for`: the publisher's (tracing.py), so that a final sent
        here carries its trace context as one sent by the publisher does. Progress records go to the progress
        topic's partition of the same number as the request partition; returns the offset of the first."""
        groups: dict[tuple[str, int], list[tuple[bytes | None, bytes]]] = {}
        if progress_records:
            groups[(self.progress_topic, progress_partition)] = list(progress_records)
        for topic, key, value in records:
            groups.setdefault((topic, await self.publisher.partition_of(topic, key)), []).append((key, value))
        futures = []
        first_progress = None
        for (topic, partition), group in groups.items():
            state = self.publisher.destinations.state(topic)
            limit = state.max_message_bytes if state is not None else DEFAULT_MAX_MESSAGE_BYTES
            start = 0
            while start < len(group):
                batch = producer.create_batch()
                # Within the topic's limit: a batch the broker refuses would abort the whole transaction.
                end = fill_batch(batch, group, start, limit, headers_for)
                if end == start:  # larger than a batch alone (its topic's limit was checked): aiokafka's own path
                    key, value = group[start]
                    futures.append(await producer.send(topic, value, key=key, partition=partition,
                                                       headers=headers_for(key, value) if headers_for else None))
                    start += 1
                    continue
                futures.append(await producer.send_batch(batch, topic, partition=partition))
                if first_progress is None and topic == self.progress_topic and progress_records:
                    first_progress = futures[-1]
                start = end
        await asyncio.gather(*futures)
        return None if first_progress is None else first_progress.result().offset

    async def _replace_producer(self, lane: Lane) -> None:
        """A new producer under the lane's transactional id (the partition is still ours: only a lane that is not
        fenced gets here); starting it fences the stuck one, whose batches are failed so nothing waits on them."""
        old = lane.producer
        # Stuck by definition: a second, then what it holds is failed and its connections closed.
        await stop_client(old, f"stuck lane producer of {lane.partition}", timeout_s=1.0,
                          unsent_error=KafkaError("lane producer replaced"))
        fail_unsent_batches(old, KafkaError("lane producer replaced"))
        replacement = await self._start_producer(lane.partition)
        lane.producer = replacement
        lane.needs_new_producer = False
        log.warning("replaced the transactional producer of %s", lane.partition)

    async def _deliverable(self, records: list[AnswerRecord]) -> list[tuple[str, bytes | None, bytes]]:
        """The records as they can be written: one record a transaction cannot take (a missing or denied topic,
        over its limit) would abort the whole transaction, so each is checked first and replaced as the
        publisher's fallback would (Answers.replacement); chunks and dead letters that do not fit are dropped."""
        out = []
        for topic, key, value, final in records:
            while True:
                problem = await self._problem(topic, key, value)
                if problem is None:
                    out.append((topic, key, value))
                    break
                code, message = problem
                found = self.replacement(topic, final, code, message) if final is not None else None
                if found is None:
                    log.warning("an answer for %s dropped: %s", topic, message)
                    break
                topic, final = found
                key, value = final.id.encode(), encode(final)
        return out

    async def _problem(self, topic: str, key: bytes | None, value: bytes) -> tuple[str, str] | None:
        destinations = self.publisher.destinations
        state = destinations.state(topic)
        if state is None:
            done = asyncio.Event()
            destinations.resolve(topic, on_done=done.set)
            await done.wait()
            state = destinations.state(topic)
            if state is None:
                return None  # looked up but already stale: let the broker judge
        return record_problem(state, topic, key, value)

    def stats(self) -> dict[str, int]:
        return {"lanes": len(self._lanes), "fenced": self.num_fenced, "aborted": self.num_aborted,
                "progress_records": self.num_progress_records,
                "progress_full": self.num_progress_full,
                "transactions": sum(lane.num_transactions for lane in self._lanes.values())}
