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
max_poll_records budget; within a priority each partition first gets an equal part of what is left, so a
backlogged partition does not keep its neighbours unread). A priority is fetched only while fewer than
max_waiting requests of it or of more urgent priorities wait locally, except partitions being shed (their
records are answered, never queued): a local queue full of less urgent work never keeps an urgent record
unread in Kafka, and it stays below num_priorities × (max_waiting + max_poll_records).

Unreadable batches. A record batch that cannot be read (a compression codec this process lacks, corrupt
bytes) would fail every fetch of its partition forever. The partition is then read one record at a time: the
records before the bad batch come through, and the first offset that fails is answered with a dead letter
(partition and offset, no bytes) and skipped with a seek, until reads succeed again. A batch of N records
costs N refetches: slow, but it never stalls the partition or the others.

Layout. The request topic's partitions carry priorities by the configured layout (num_priorities x
partitions_per_priority). Partitions past it (the topic grew) are paused and never read: reading them under
some other layout would silently re-prioritise the records already in them. The worker also refuses to start
on a topic whose partition count differs (worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import groupby
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError, RecordTooLargeError, UnsupportedCodecError

from schemas.decode import RequestError, decode_request, encode
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.priority import priority_of_partition
from schemas.progress import ProgressRecord
from worker.transport.load.admission import estimate_prompt_tokens
from worker.transport.requests.answers import Answers
from worker.transport.load.load_control import LoadDecision
from worker.transport.requests.lifecycle import Lifecycle
from worker.transport.requests.local_queue import UNTRACED, QueuedRequest, resumable
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.kafka.progress import Runs
from worker.transport.load.shedding import ReachFraction
from worker.transport.load.tenants import DEFAULT_TENANT
from worker.transport.requests.tracing import NoTracing, RequestTracing

log = logging.getLogger(__name__)

UNREADABLE_BATCH_ERRORS = (CorruptRecordException, UnsupportedCodecError, RecordTooLargeError, ValueError, TypeError,
                           IndexError, UnicodeError, OverflowError, MemoryError)
"""What reading a record batch raises when the batch itself is at fault (a codec this process lacks, corrupt
bytes), as opposed to the broker or the network: refetching the same batch fails the same way."""
SUSPECT_QUIET_S = 10.0
"""...or once it has read nothing and seen no error for this long after the last one."""
SUSPECT_CLEAR_AFTER = 500
"""A partition read record by record after a batch error goes back to normal reads after this many records
without another error (the error did not repeat)."""


@dataclass(slots=True, frozen=True)
class IntakeLayout:
    """What the intake reads and how much: the request topic's layout and the per-record settings."""

    num_priorities: int
    num_partitions: int
    result_topic: str
    max_poll_records: int = 500
    limits: Limits = DEFAULT_LIMITS
    max_clock_skew_ms: float = 1000.0
    progress_max_bytes: int = 0
    """With exactly-once finals, the size the progress metadata of a commit stays within (progress.py): a
    partition whose record of it is past half stops being read until its watermark moves. 0: no such record."""

    @classmethod
    def from_settings(cls, kafka, settings, limits: Limits = DEFAULT_LIMITS) -> "IntakeLayout":
        """From KafkaSettings and WorkerSettings."""
        return cls(kafka.num_priorities, kafka.num_request_partitions, kafka.result_topic, settings.max_poll_records,
                   limits, settings.max_clock_skew_ms,
                   kafka.offset_metadata_max_bytes if kafka.exactly_once else 0)


class Intake:
    def __init__(
        self, consumer: AIOKafkaConsumer, tracker: OffsetTracker, lifecycle: Lifecycle, answers: Answers,
        layout: IntakeLayout, tracing: RequestTracing | NoTracing = NoTracing(),
    ) -> None:
        self.consumer = consumer
        self.tracing = tracing
        """tracing.RequestTracing when tracing is on: traced records start their spans here."""
        self.tracker = tracker
        self.lifecycle = lifecycle
        """Every request read goes to it (Lifecycle.arrive), which decides what becomes of it."""
        self.queue = lifecycle.queue
        self.answers = answers
        """For records that are no request: undecodable, or unreadable from their batch."""
        self.num_priorities = layout.num_priorities
        self.num_partitions = layout.num_partitions
        self.result_topic = layout.result_topic
        self.max_poll_records = layout.max_poll_records
        self.limits = layout.limits
        self.max_clock_skew_ms = layout.max_clock_skew_ms
        self.progress_max_bytes = layout.progress_max_bytes
        self.reach = ReachFraction(layout.num_priorities)
        self.assigned: set[TopicPartition] = set()
        """Assigned partitions inside the layout: the ones this worker reads."""
        self.outside_layout: set[TopicPartition] = set()
        self._suspects: dict[TopicPartition, int] = {}
        """Partitions read record by record after a batch error -> records read since without an error."""
        self._suspect_until: dict[TopicPartition, float] = {}
        """A suspect that reads nothing (refetching, or idle) returns to normal reads after this time."""
        self.paused: set[TopicPartition] = set()
        self.group_generation = -1
        self.held_through: Callable[[], list[int] | None] | None = None
        """The request partitions the last assignment says this worker held without a break since the one
        before, through any generation it missed (PriorityRoundRobinAssignor.kept); None: unknown."""
        self.fetching_stopped = False
        self._failed: KafkaError | None = None
        """A fetch error raised after records were drained: fetch_once handles those records, then raises it."""
        self._turn = 0
        """Which of a priority's partitions a poll asks first (it moves on by one each poll: _fetch_shared)."""
        self._suspended: set[TopicPartition] = set()
        """Revoked in the rebalance under way; kept or given up at its assignment."""
        self._resumable: dict[TopicPartition, dict[str, ProgressRecord]] = {}
        """Progress read at takeover (kafka/resume.py) of requests not read here yet: each continues its stream
        from its record when its request record comes."""
        self.num_resumed = 0
        self.num_resumed_tokens = 0
        """Requests that went on from an earlier attempt's output, and the output tokens they did not generate
        again."""

    # -- resumption ----------------------------------------------------------------------------------------
    def expect_resumed(self, found: dict[TopicPartition, dict[str, ProgressRecord]]) -> None:
        self._resumable.update(found)

    def unserved_resumed(self, tp: TopicPartition) -> list[tuple[bytes, bytes]]:
        """Progress records of this partition's requests that continue an earlier attempt but have not reached
        the engine yet (unread, or waiting here), as they were read."""
        records = [(r.id.encode(), encode(r)) for r in self._resumable.get(tp, {}).values()]
        records += [(q.request.id.encode(), encode(q.resume)) for q in self.queue
                    if q.partition == tp and q.resume is not None]
        return records

    def _resume_of(self, tp: TopicPartition, request_id: str, offset: int, attempt: int) -> ProgressRecord | None:
        found = self._resumable.get(tp)
        record = found.pop(request_id, None) if found else None
        if record is None or record.offset != offset or record.attempt >= attempt:
            return None  # another record of the same id (a duplicate id), or not an earlier attempt's
        tokens = sum(len(c.token_ids) for c in record.completions)
        self.num_resumed += 1
        self.num_resumed_tokens += tokens
        metrics = self.answers.metrics
        metrics.requests_resumed.inc()
        metrics.resumed_tokens.inc(tokens)
        return record

    # -- partitions ----------------------------------------------------------------------------------------
    def priority_of(self, tp: TopicPartition) -> int:
        return priority_of_partition(tp.partition, self.num_partitions, self.num_priorities)

    def partitions_of(self, priority: int) -> list[TopicPartition]:
        return sorted(tp for tp in self.assigned if self.priority_of(tp) == priority)

    def readable(self, tp: TopicPartition) -> bool:
        """Not paused (backpressure), and not waiting for its watermark to move (exactly-once progress)."""
        return tp not in self.paused and not (
            self.progress_max_bytes and self.tracker.progress_full(tp, self.progress_max_bytes))

    def commit_waiting(self) -> list[TopicPartition]:
        """Assigned partitions not read until their watermark moves: their progress metadata is nearly full."""
        if not self.progress_max_bytes:
            return []
        return sorted(tp for tp in self.assigned if self.tracker.progress_full(tp, self.progress_max_bytes))

    def paused_by_priority(self) -> list[list[int]]:
        paused: list[list[int]] = [[] for _ in range(self.num_priorities)]
        for tp in sorted(self.paused):
            paused[self.priority_of(tp)].append(tp.partition)
        return paused

    def missed_a_generation(self, group_generation: int) -> bool:
        """Whether the group went through a generation without this worker (its session expired: a long pause, a
        frozen process): whatever it held may have had another owner meanwhile, who answered and committed."""
        return self.group_generation >= 0 and group_generation > self.group_generation + 1

    def kept_of(self, assigned: set[TopicPartition], group_generation: int,
                lost: set[TopicPartition] = frozenset()) -> set[TopicPartition]:
        """The partitions of a new assignment that this worker keeps from before the rebalance: revoked at its
        start and assigned again, with no other owner in between. After a missed generation, or for partitions
        `lost` (another worker's producer fenced their exactly-once lane), there may have been one: such a
        partition starts over from its committed offset, like any partition that moves here."""
        kept = (self._suspended & assigned) - lost
        if self.missed_a_generation(group_generation):
            # Unless the assignment says it held the partition through the generations it missed: a join that
            # arrives while the group waits for its leader's assignment fails that generation's syncs, and its
            # members come back one generation on having held no partition of it; a leader that made that
            # generation's assignment knows whom it gave each partition.
            held = self.held_through() if self.held_through else None
            return {tp for tp in kept if tp.partition in held} if held else set()
        return kept

    def on_assigned(self, assigned: set[TopicPartition], group_generation: int,
                    progress: dict[TopicPartition, tuple[int, Runs]] | None = None,
                    lost: set[TopicPartition] = frozenset()) -> set[TopicPartition]:
        """The group's new assignment. Suspended partitions (revoked at the start of this rebalance) that came
        back are kept as they were: their waiting requests return to the queue, their watermarks stay, and
        reading resumes after the last record this worker consumed (not from the committed offset, which
        would fetch in-flight requests a second time). The others start from their committed offset, skipping
        the offsets above it that `progress` says are answered (exactly-once: progress.py). Returns the
        suspended partitions that went elsewhere, or that may have had another owner since (kept_of): the
        caller gives up their requests (Lifecycle.settle)."""
        kept = self.kept_of(assigned, group_generation, lost)
        moved = self._suspended - kept
        if moved & assigned:
            log.warning("partitions %s may have had another owner since this worker last held them (a missed "
                        "generation, or a fenced lane): their requests here are dropped and they are read again "
                        "from their committed offsets", sorted(tp.partition for tp in moved & assigned))
        self._suspended = set()
        self._resumable = {tp: found for tp, found in self._resumable.items() if tp in assigned}
        for tp in moved:
            self.tracker.revoke(tp)
        self.outside_layout = {tp for tp in assigned if not 0 <= tp.partition < self.num_partitions}
        assigned = assigned - self.outside_layout
        if self.outside_layout:
            log.error("request partitions %s are outside the configured layout (%d priorities x %d partitions = "
                      "%d): they are not read; set KAFKA_NUM_PRIORITIES / KAFKA_PARTITIONS_PER_PRIORITY to the "
                      "topic's layout, or move those records", sorted(tp.partition for tp in self.outside_layout),
                      self.num_priorities, self.num_partitions // self.num_priorities, self.num_partitions)
            self.consumer.pause(*self.outside_layout)  # else the background fetcher would buffer their records
        self.assigned = assigned
        self._suspects = {tp: n for tp, n in self._suspects.items() if tp in assigned}
        self.paused &= assigned
        self.group_generation = group_generation
        for tp in assigned:
            position = self.tracker.next_offset(tp) if tp in kept else None
            if position is not None:
                self.consumer.seek(tp, position)
            elif progress and progress.get(tp, (0, []))[1]:
                committed, runs = progress[tp]
                self.tracker.assign(tp, committed, committed, runs)
                log.info("partition %d: %d offsets above its committed offset %d are answered already; skipped",
                         tp.partition, sum(last - first + 1 for first, last in runs), committed)
            else:
                self.tracker.revoke(tp)  # start clean: watermark state is created at the first record fetched
        log.info("assigned %s (generation %d); kept %s, moved away %s", sorted(tp.partition for tp in assigned),
                 group_generation, sorted(tp.partition for tp in kept), sorted(tp.partition for tp in moved))
        return moved

    def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Revoked at the start of a rebalance (commit them first; the lifecycle holds their requests): stop
        reading them, but forget nothing yet; the assignment that ends the rebalance (on_assigned) says which of
        them stay with this worker."""
        self._suspended |= revoked & self.assigned
        self.assigned -= revoked
        self.outside_layout -= revoked
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
        load = self.lifecycle.load
        shed = load.shed_priorities if load else frozenset()
        overflow = self.lifecycle.overflow_priorities(time.monotonic())
        budget = self.max_poll_records
        waiting, ahead, priorities = self.queue.num_waiting_by_priority(), 0, []
        for priority in range(self.num_priorities):
            ahead += waiting[priority]
            if ahead < self.queue.max_waiting or priority in shed or priority in overflow:
                priorities.append(priority)
        room = len(priorities) > 0
        # (partition, records, generation when getmany returned them): the generation read after the call,
        # since a rebalance inside getmany resets positions and the records then belong to the new one.
        batches: list[tuple[TopicPartition, list, int]] = []
        try:
            for priority in priorities:
                parts = [tp for tp in self.partitions_of(priority) if self.readable(tp)]
                if parts and budget > 0 and self._failed is None:
                    for tp, msgs in (await self._fetch(parts, 0, budget)).items():
                        batches.append((tp, msgs, self.group_generation))
                        budget -= len(msgs)
        except KafkaError as exc:
            if not batches:
                raise
            self._failed = exc  # the records already drained are handled first; then it is raised
        if not batches:
            if not room:
                try:
                    await asyncio.wait_for(self.queue.space.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                return
            readable = sorted(tp for tp in self.assigned if self.readable(tp) and self.priority_of(tp) in priorities)
            got = await self._fetch(readable, 50, budget)
            batches = [(tp, msgs, self.group_generation) for tp, msgs in
                       sorted(got.items(), key=lambda item: self.priority_of(item[0]))]
        for tp, msgs, generation in batches:
            num_seen = num_invalid = 0
            for msg in msgs:
                if self.group_generation != generation or tp not in self.assigned:
                    # A rebalance happened while we handled earlier records. The watermark is below these
                    # untracked records, and the partition's next owner (maybe us) reads them again.
                    break
                num_seen += 1
                num_invalid += self.handle(tp, msg, generation) == "invalid"
            if num_seen:
                self.reach.observe(self.priority_of(tp), num_seen, num_invalid)
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    async def _fetch(self, parts: list[TopicPartition], timeout_ms: int, budget: int) -> dict:
        """Records of `parts`, up to `budget`, waiting up to timeout_ms for the first. One getmany per partition:
        aiokafka moves a partition's position as it drains it, so a multi-partition call that fails on a later
        partition would lose the records it had drained from the earlier ones; a failing single-partition call
        loses nothing (its position stays). A partition whose batch failed is then read record by record.
        A broker error (an ACL withdrawn) after records were drained is kept in self._failed and the records
        returned: their positions have moved, so dropping them would lose them until a rebalance."""
        got: dict = {}
        try:
            return await self._fetch_into(got, parts, timeout_ms, budget)
        except KafkaError as exc:
            if not got:
                raise
            self._failed = exc
            return got

    async def _fetch_into(self, got: dict, parts: list[TopicPartition], timeout_ms: int, budget: int) -> dict:
        waitable = [tp for tp in parts if tp not in self._suspects]
        if timeout_ms and waitable:
            try:  # wait for data; max_records=1 drains one partition at most, so a failure here loses nothing
                got.update(await self.consumer.getmany(*waitable, timeout_ms=timeout_ms, max_records=1))
            except UNREADABLE_BATCH_ERRORS as exc:
                # aiokafka does not say which partition failed, and the failed read is spent (the next read of
                # that partition refetches it): read all of them record by record for a while, each on its
                # own, so the failure shows again where it belongs.
                self._suspect(waitable, exc)
            budget -= sum(len(msgs) for msgs in got.values())
        elif timeout_ms:
            # Nothing to wait on (all paused, or all read record by record, which never blocks): still give the
            # loop its turn, or this caller would spin without ever yielding.
            await asyncio.sleep(timeout_ms / 1000)
        # Most urgent priority first; within a priority the budget is shared: each partition is first asked for
        # an equal part of it, then for what the others left, starting one partition further at each poll. Asked
        # in a fixed order for the whole budget, a partition with a backlog took it at every poll, and the next
        # one was never read while the backlog lasted (the requests there waited in Kafka until shed).
        for _, group in groupby(sorted(parts, key=self.priority_of), key=self.priority_of):
            budget = await self._fetch_shared(got, list(group), budget)
        return got

    async def _fetch_shared(self, got: dict, parts: list[TopicPartition], budget: int) -> int:
        """Records of one priority's partitions into `got`, up to `budget` shared among them; what is left."""
        turn = self._turn % len(parts)
        self._turn += 1
        order = parts[turn:] + parts[:turn]
        for share in (max(1, budget // len(order)), None):
            for tp in order:
                if budget <= 0:
                    return budget
                if tp in self._suspects:
                    records = await self._fetch_one(tp)
                else:
                    try:
                        records = await self.consumer.getmany(tp, timeout_ms=0,
                                                              max_records=min(budget, share or budget))
                    except UNREADABLE_BATCH_ERRORS as exc:
                        self._suspect([tp], exc)
                        records = await self._fetch_one(tp)
                for tp_got, msgs in records.items():
                    got.setdefault(tp_got, []).extend(msgs)
                    budget -= len(msgs)
        return budget

    def _suspect(self, parts: list[TopicPartition], exc: Exception) -> None:
        log.warning("a record batch of partitions %s could not be read (%r); reading record by record",
                    sorted(tp.partition for tp in parts), exc)
        self._suspects.update({tp: 0 for tp in parts})
        self._suspect_until.update({tp: time.monotonic() + SUSPECT_QUIET_S for tp in parts})

    async def _fetch_one(self, tp: TopicPartition) -> dict:
        try:
            got = await self.consumer.getmany(tp, timeout_ms=0, max_records=1)
        except UNREADABLE_BATCH_ERRORS as exc:
            await self._skip_unreadable(tp, exc)
            return {}
        if got:
            self._suspects[tp] += 1
            if self._suspects[tp] >= SUSPECT_CLEAR_AFTER:
                del self._suspects[tp]
        elif time.monotonic() > self._suspect_until.get(tp, 0.0):
            del self._suspects[tp]  # quiet since the error: back to normal reads
        return got

    async def _skip_unreadable(self, tp: TopicPartition, exc: Exception) -> None:
        """The next record of tp cannot be read: dead-letter its offset and seek past it. Read one record at a
        time, the position is exactly the first offset of the batch that failed (or the next one inside it)."""
        offset = await self.consumer.position(tp)
        self._suspects[tp] = 0
        self._suspect_until[tp] = time.monotonic() + SUSPECT_QUIET_S
        log.error("partition %d offset %d cannot be read (%r); dead-lettered and skipped", tp.partition, offset, exc)
        if self.tracker.track(tp, offset):
            self.answers.unreadable(tp, offset, f"the record batch holding this offset cannot be read: {exc!r}")
        self.consumer.seek(tp, offset + 1)

    def handle(self, tp: TopicPartition, msg, attempt: int) -> str:
        """Decode one record and hand the request to the lifecycle, which answers it at once (error, rejection)
        or queues it. Never raises for bad input: schemas.decode turns any bytes into a request or a
        RequestError. Returns what became of it: "queued", "invalid" (refused for what it is), "load" (shed or
        deadline), "cancelled" (its cancel came first) or "seen" (a refetch)."""
        if not self.tracker.track(tp, msg.offset):
            return "seen"
        decoded = decode_request(msg.value, self.limits)
        if isinstance(decoded, RequestError):
            self.answers.dead_letter(tp, msg, decoded, attempt)
            return "invalid"
        req = decoded
        now_ms = time.time() * 1000.0
        queued = QueuedRequest(
            request=req, partition=tp, offset=msg.offset, priority=self.priority_of(tp), attempt=attempt,
            timestamp_ms=msg.timestamp, deadline_ms=req.deadline_at_ms(msg.timestamp),
            reply_topic=req.reply_topic or self.result_topic,
            num_prompt_tokens=estimate_prompt_tokens(req.prompt, req.messages, req.prompt_token_ids,
                                                     req.num_tools_chars),
            arrival_ms=max(float(msg.timestamp), now_ms - self.max_clock_skew_ms),
            tenant=req.tenant if req.tenant is not None else DEFAULT_TENANT, read_ms=now_ms,
        )
        if self._resumable and resumable(req):
            queued.resume = self._resume_of(tp, req.id, msg.offset, attempt)
        queued.trace = self.tracing.begin(msg.headers, req.id.encode(), queued) or UNTRACED
        return self.lifecycle.arrive(queued)

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
        """The lifecycle answers the waiting requests of newly shed priorities; partitions are paused and
        resumed as decided."""
        self.lifecycle.apply(decision)
        if not self.fetching_stopped:
            # A priority that overflows (contended by tenants) is read on past a full queue or a full KV cache:
            # what it reads waits in the bounded local queue, and pausing would hold the other tenants' records
            # in Kafka behind the flood's. A more urgent priority's backlog still pauses it.
            overflow = self.lifecycle.overflow_priorities(time.monotonic())
            reasons = {p: r for p, r in decision.pause_reasons.items()
                       if not (r in ("queue", "kv") and p in overflow)}
            self._set_paused({tp for tp in self.assigned if self.priority_of(tp) in reasons}, reasons)

    def _set_paused(self, want: set[TopicPartition], reasons: dict[int, str]) -> None:
        to_pause, to_resume = want - self.paused, self.paused - want
        try:
            if to_pause:
                self.consumer.pause(*to_pause)
                log.info("paused %s (%s)", sorted(tp.partition for tp in to_pause), reasons)
            if to_resume:
                self.consumer.resume(*to_resume)
                log.info("resumed %s", sorted(tp.partition for tp in to_resume))
        except Exception:  # e.g. a partition revoked in between; the next tick retries
            log.debug("pause/resume failed", exc_info=True)
            return
        self.paused = set(want)

    def stop_fetching(self) -> None:
        """At shutdown: pause every partition and leave them paused."""
        self.fetching_stopped = True
        if self.assigned:
            try:
                self.consumer.pause(*self.assigned)
            except Exception:
                log.debug("pause at shutdown failed", exc_info=True)
