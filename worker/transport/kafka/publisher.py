"""Result, dead-letter and status records out to Kafka: idempotent producer, acks=all, batched by hand.

`publish` only appends to a buffer; a flusher task groups the buffer by (topic, partition), builds aiokafka
batches (`create_batch` / `send_batch`) and attaches one callback per batch. Per-record `producer.send`
costs about 150 us of Python on these machines, which alone would cap a worker near 5,000 records/s; a
batch costs that once. Records keep their publish order within a partition (one request's chunks and
final share a partition, since the key is the request id), and the partition of a key is Kafka's default
(murmur2), so any worker sends a request's records to the same partition.

A batch that fails for any reason but size (the broker was away past the producer's timeout; an idempotent
producer then also fails every later batch of that partition with OutOfOrderSequenceNumber, and aiokafka's
sender stops) makes the publisher replace its producer; the failed records go back to the buffer in their
original order and are sent again by the new producer. Offsets stay pending until records land, so nothing
is lost; a record may then be duplicated (at-least-once), never reordered within a partition.

A group of records that together answer one request record (say a dead-letter record and an error final)
calls `on_acked` once, after the last one is acknowledged: only then may the request-topic offset count as
done (offsets.py).

A record that can never be delivered where it is addressed (its topic is missing or denied, or it exceeds the
topic's record limit: destinations.py) never enters the producer and never delays other records: it is
handed to its `on_failed` (a final record's sender publishes a replacement there, say an `error` final on the
result topic) or, without one, dropped and counted. Either way its offset moves on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError, TopicAuthorizationFailedError
from aiokafka.partitioner import DefaultPartitioner

from worker.kafka_stop import stop_client
from worker.transport.kafka.aiokafka_compat import fail_unsent_batches, stop_tracking_topic
from worker.transport.kafka.destinations import BrokerProbe, Destinations, TopicState, record_problem, record_size

log = logging.getLogger(__name__)

Record = tuple[str, bytes | None, bytes]
"""(topic, key, value)"""
OnFailed = Callable[[str, str, Callable[[], None]], None]
"""Called with (reason code, message, the record's on_acked) when a record cannot be delivered where it is
addressed: it may publish a replacement, which must call that on_acked once acknowledged."""
_BufferedRecord = tuple[str, bytes | None, bytes, Callable[[], None], int, OnFailed | None]
"""(topic, key, value, on_acked, sequence number that restores publish order after a failure, on_failed)"""

MAX_BUFFERED = 50_000
"""Records waiting for the flusher above which `publish` waits: bounds memory while the broker is away."""
PARTITIONS_TTL_S = 30.0
KEY_PARTITIONS_MAX = 100_000
"""Keys whose partition is remembered (a request's id while it streams); the memory is cleared when full."""


def fill_batch(batch, items: list[tuple[bytes | None, bytes]], start: int, limit: int,
               headers_for: Callable[[bytes | None, bytes], list | None] | None) -> int:
    """Append (key, value) items from `start` to a producer batch, up to the topic's record limit (a batch is
    refused whole when it exceeds it) and the batch's own size; returns the index after the last one appended
    (`start` when not even the first fits a batch)."""
    end, size = start, 0
    while end < len(items):
        key, value = items[end]
        size += record_size(key, value)
        if end > start and size > limit:
            break
        headers = headers_for(key, value) if headers_for else None
        if headers:
            appended = batch.append(key=key, value=value, timestamp=None, headers=headers)
        else:
            appended = batch.append(key=key, value=value, timestamp=None)
        if appended is None:
            break
        end += 1
    return end


def _nothing() -> None:
    pass


class Publisher:
    def __init__(self, client_kwargs: dict, max_request_size: int = 4 * 1024 * 1024, linger_ms: int = 2,
                 on_dropped: Callable[[str], None] = lambda topic: None,
                 gather_s: Callable[[], float] = lambda: 0.0, topic_wait_s: float = 5.0,
                 on_topic_change: Callable[[str, TopicState], None] = lambda topic, state: None,
                 track_settled: bool = False,
                 headers_for: Callable[[bytes | None, bytes], list | None] | None = None) -> None:
        self._producer_kwargs = dict(
            **client_kwargs, enable_idempotence=True, acks="all", linger_ms=linger_ms,
            max_request_size=max_request_size, max_batch_size=256 * 1024,
        )
        self._producer = AIOKafkaProducer(**self._producer_kwargs)
        self._max_request_size = max_request_size
        self.on_topic_change = on_topic_change
        self.destinations = Destinations(BrokerProbe(lambda: self._producer.client, client_kwargs),
                                         wait_s=topic_wait_s, on_change=self._topic_changed)
        self.send_wait_s = max(1.0, topic_wait_s)
        """How long handing one batch to the producer may wait (its partition's previous batch stuck, or the
        topic gone from the producer's metadata) before the topic is looked up again and its records wait aside."""
        self._parked: dict[str, list[_BufferedRecord]] = defaultdict(list)
        self._inflight: dict[int, tuple[str, float]] = {}
        self._batch_caps: dict[str, int] = {}
        """Per topic, a batch size below the one the broker last refused as too large: the limit it reported may
        have been lowered since, or be above the broker's own. Halved at each such refusal, so at worst records go
        one to a batch and only a record too large on its own is refused."""
        """Batches handed to the producer and not yet resolved: (topic, when handed), by batch id."""
        self._batch_id = 0
        self._watchdog: asyncio.Task | None = None
        """Records whose topic is being looked up, in publish order."""
        self.num_undeliverable = 0
        self.track_settled = track_settled
        """Count unsettled records by key, for `has_unsettled` (an exactly-once lane writes a request's final
        only once its chunks are settled)."""
        self._needs_new_producer = False
        self._seq = 0
        self.num_producer_resets = 0
        self.num_dropped_records = 0
        self.num_batches_sent = 0
        self.on_dropped = on_dropped
        """Called with the topic of each record dropped as undeliverable (a metric)."""
        self.gather_s = gather_s
        """How long the flusher lets records gather after the first one wakes it (worker.io_gather_s)."""
        self.headers_for = headers_for
        """(key, value) -> a record's headers, or None for none: the trace context (tracing.py) when on."""
        self._partitioner = DefaultPartitioner()
        self._key_partitions: dict[tuple[str, bytes], int] = {}
        self._partitions: dict[str, tuple[float, list[int]]] = {}
        self._buffer: list[_BufferedRecord] = []
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_unacked = 0
        self._unsettled_keys: dict[bytes | None, int] = {}
        """Records published and not yet settled, by key (only with `track_settled`)."""
        self._flusher: asyncio.Task | None = None
        self.retry_backoff_s = 0.5

    async def start(self) -> None:
        await self._producer.start()
        self._flusher = asyncio.create_task(self._flush_loop())
        self._watchdog = asyncio.create_task(self._watch_stuck_batches())

    async def stop(self) -> None:
        for task in (self._flusher, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.destinations.stop()
        await stop_client(self._producer, "result producer")

    @property
    def num_cached_keys(self) -> int:
        """Keys whose partition is remembered now (at most KEY_PARTITIONS_MAX)."""
        return len(self._key_partitions)

    @property
    def num_unacked(self) -> int:
        return self._num_unacked

    async def publish(self, topic: str, key: bytes | None, value: bytes,
                      on_acked: Callable[[], None] | None = None) -> None:
        self.publish_nowait(topic, key, value, on_acked)
        await self.wait_room()

    def publish_group_nowait(self, records: list[tuple[str, bytes | None, bytes, OnFailed | None]],
                             on_acked: Callable[[], None] | None = None) -> None:
        """Buffer records that answer one thing together: `on_acked` runs once, after the last is acknowledged
        (or answered elsewhere by its `on_failed`, the fourth element)."""
        remaining = [len(records)]

        def one_acked() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and on_acked is not None:
                on_acked()

        for topic, key, value, on_failed in records:
            self.publish_nowait(topic, key, value, one_acked, on_failed)

    def publish_nowait(self, topic: str, key: bytes | None, value: bytes, on_acked: Callable[[], None] | None = None,
                       on_failed: OnFailed | None = None) -> None:
        """Buffer one record; the hot path (no coroutine). Call `wait_room` now and then to bound the buffer.
        `on_failed`: what to do instead when the record cannot be delivered (see OnFailed); without it such a
        record is dropped, counted, and `on_acked` still runs."""
        self._num_unacked += 1
        self._seq += 1
        if self.track_settled:
            self._unsettled_keys[key] = self._unsettled_keys.get(key, 0) + 1
        self._buffer.append((topic, key, value, on_acked or _nothing, self._seq, on_failed))
        self._idle.clear()
        self._wake.set()

    async def wait_room(self) -> None:
        while len(self._buffer) > MAX_BUFFERED:
            self._drained.clear()
            await self._drained.wait()

    async def wait_acked(self, timeout_s: float | None = None) -> bool:
        """Wait until every published record is acknowledged; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def metadata(self):
        """A fresh look at every topic's partitions (aiokafka ClusterMetadata); never creates a topic."""
        return await self._producer.client.fetch_all_metadata()

    async def partition_of(self, topic: str, key: bytes | None) -> int:
        """The partition a record of this key goes to (Kafka's default partitioner, as any producer would)."""
        cached = self._partitions.get(topic)
        if cached is None or time.monotonic() - cached[0] > PARTITIONS_TTL_S:
            cached = (time.monotonic(), sorted(await self._producer.partitions_for(topic)))
            self._partitions[topic] = cached
            self._key_partitions.clear()  # the partition count may have changed
        partitions = cached[1]
        if key is None:
            return self._partitioner(key, partitions, partitions)
        # A request's chunks and final share its key: hash it once (aiokafka's murmur2 is pure Python, and
        # was a fifth of the event loop's time at 16,000 records/s in the simulated-GPU benchmark).
        found = self._key_partitions.get((topic, key))
        if found is None:
            if len(self._key_partitions) >= KEY_PARTITIONS_MAX:
                self._key_partitions.clear()
            found = self._key_partitions[(topic, key)] = self._partitioner(key, partitions, partitions)
        return found

    async def _watch_stuck_batches(self) -> None:
        """A batch unresolved for long may be for a topic deleted since it was sent: look its topic up again
        (_topic_changed replaces the producer when the topic is gone)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for topic in {t for t, handed_at in self._inflight.values() if now - handed_at > self.send_wait_s}:
                if topic not in self._parked:
                    self.destinations.forget(topic)
                    self.destinations.resolve(topic)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            gather = self.gather_s()
            if gather > 0 and len(self._buffer) < MAX_BUFFERED // 2:
                await asyncio.sleep(gather)
            self._wake.clear()
            if self._needs_new_producer and not self._buffer:
                await self._replace_producer()
            while self._buffer:
                if self._needs_new_producer:
                    await self._replace_producer()
                records, self._buffer = self._buffer, []
                self._drained.set()
                try:
                    await self._send(records)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - broker away: _send put the records back; try later
                    log.warning("cannot hand records to the producer (%r); retrying in %.1fs", exc,
                                self.retry_backoff_s)
                    await asyncio.sleep(self.retry_backoff_s)

    async def _send(self, records: list[_BufferedRecord]) -> None:
        groups: dict[tuple[str, int], list[_BufferedRecord]] = defaultdict(list)
        limits: dict[str, int] = {}
        handed: set[int] = set()
        for record in records:
            topic = record[0]
            state = self.destinations.state(topic)
            if state is None or topic in self._parked:
                handed.add(record[4])
                self._park(record)
            elif (problem := record_problem(state, topic, record[1], record[2], self._max_request_size)) is not None:
                handed.add(record[4])
                self._undeliverable(record, *problem)
            else:
                limits[topic] = min(state.max_message_bytes, self._max_request_size,
                                    self._batch_caps.get(topic, self._max_request_size))
                groups[(topic, await self.partition_of(topic, record[1]))].append(record)
        try:
            for (topic, partition), group in groups.items():
                if topic in self._parked:  # an earlier group of this topic found it stuck: keep the order
                    for record in group:
                        handed.add(record[4])
                        self._park(record)
                    continue
                items = [(r[1], r[2]) for r in group]
                start = 0
                while start < len(group):
                    batch = self._producer.create_batch()
                    end = fill_batch(batch, items, start, limits[topic], self.headers_for)
                    if end == start:
                        handed.add(group[start][4])
                        self._undeliverable(group[start], "result_too_large", "does not fit a producer batch")
                        start += 1
                        continue
                    chunk = group[start:end]
                    try:
                        future = await asyncio.wait_for(self._producer.send_batch(batch, topic, partition=partition),
                                                        self.send_wait_s)
                    except asyncio.TimeoutError:
                        # The partition's last batch is stuck, or the topic left the producer's metadata (deleted
                        # while we write to it?): set the topic's records aside and look it up again.
                        log.warning("handing records for %s[%d] to the producer took over %.1f s; checking the topic",
                                    topic, partition, self.send_wait_s)
                        self.destinations.forget(topic)
                        for record in group[start:]:
                            handed.add(record[4])
                            self._park(record)
                        break
                    self.num_batches_sent += 1
                    handed.update(r[4] for r in chunk)
                    producer_epoch = self.num_producer_resets
                    self._batch_id += 1
                    self._inflight[self._batch_id] = (topic, time.monotonic())
                    future.add_done_callback(lambda f, c=chunk, e=producer_epoch, b=self._batch_id:
                                             self._on_done(f, c, e, b))
                    start = end
        except BaseException:
            # Whatever was not handed to the producer goes back, in order; what was handed has its callback.
            self._buffer = sorted([r for r in records if r[4] not in handed] + self._buffer, key=lambda r: r[4])
            raise

    def _park(self, record: _BufferedRecord) -> None:
        """Set a record aside while its topic is looked up; the lookup brings it back or answers it."""
        topic = record[0]
        first = topic not in self._parked
        self._parked[topic].append(record)
        if first:
            self.destinations.resolve(topic, on_done=lambda: self._unpark(topic))

    def _unpark(self, topic: str) -> None:
        records = self._parked.pop(topic, [])
        if not records:
            return
        state = self.destinations.state(topic)
        if state is not None and not state.available:
            for record in records:
                self._undeliverable(record, "reply_topic_unavailable", state.message)
            return
        self._buffer = sorted(records + self._buffer, key=lambda r: r[4])
        self._wake.set()

    def _topic_changed(self, topic: str, state: TopicState) -> None:
        if state.available:
            log.info("topic %s is available (max.message.bytes %d)", topic, state.max_message_bytes)
        else:
            log.warning("%s; records for it are answered on the result topic or dropped", state.message)
            stop_tracking_topic(self._producer, topic)
            if any(t == topic for t, _ in self._inflight.values()):
                # An idempotent producer retries a batch for a deleted topic forever: only a new producer
                # (which fails the old one's batches, see _replace_producer) lets those records be answered.
                self._needs_new_producer = True
                self._wake.set()
        self.on_topic_change(topic, state)

    def _on_done(self, future: asyncio.Future, chunk: list[_BufferedRecord], producer_epoch: int,
                 batch_id: int) -> None:
        """`producer_epoch`: num_producer_resets when the batch was sent; failures of a producer that was
        already replaced must not replace the new one."""
        self._inflight.pop(batch_id, None)
        exc = None if future.cancelled() else future.exception()
        topic = chunk[0][0]
        if isinstance(exc, (MessageSizeTooLargeError, RecordTooLargeError)):
            # The topic's limit is below the batch (lowered since it was read): resending the same bytes fails
            # forever. The idempotent producer's sequence now has a gap the broker will not accept: replace it too.
            if producer_epoch == self.num_producer_resets:
                self._needs_new_producer = True
                self._wake.set()
            self.destinations.forget(topic)
            if len(chunk) > 1:
                # Records that may each fit: sent again in smaller batches, in order, once the limit is read again
                # (one that no longer fits on its own is answered then, before it reaches the producer).
                refused = sum(record_size(record[1], record[2]) for record in chunk)
                self._batch_caps[topic] = max(1, min(self._batch_caps.get(topic, refused), refused) // 2)
                self._buffer = sorted(chunk + self._buffer, key=lambda record: record[4])
                return
            for record in chunk:
                self._undeliverable(record, "result_too_large", f"refused by the broker as too large ({exc!r})")
            return
        if isinstance(exc, TopicAuthorizationFailedError):
            self.destinations.mark_unavailable(topic, f"not authorized to WRITE topic {topic!r}")
        if exc is not None or future.cancelled():
            state = self.destinations.state(topic)
            if state is not None and not state.available:
                for record in chunk:
                    self._undeliverable(record, "reply_topic_unavailable", state.message)
                return
            if producer_epoch == self.num_producer_resets:
                log.warning("delivery of %d records to %s failed (%r); retrying with a new producer",
                            len(chunk), topic, exc)
                self._needs_new_producer = True
            # Whether the topic is still there is looked up again before its records are sent again.
            self.destinations.forget(topic)
            # Failed batches come back in any order; sorting by publish sequence keeps each partition's order.
            self._buffer = sorted(chunk + self._buffer, key=lambda record: record[4])
            self._wake.set()
            return
        for record in chunk:
            try:
                record[3]()
            except Exception:  # a bookkeeping bug must not break the producer's callbacks
                log.exception("ack callback failed")
        self._settle(chunk)

    async def _replace_producer(self) -> None:
        self._needs_new_producer = False
        await asyncio.sleep(self.retry_backoff_s)
        old = self._producer
        self.num_producer_resets += 1
        # A second to deliver what the old producer holds: whatever it still holds then is failed and sent again,
        # in order, by the new one (a batch for a deleted topic would hold a longer wait to its full length, and
        # every other record with it). A dead sender leaves its batches unresolved; failing them sends their
        # records back to the buffer.
        await stop_client(old, "replaced result producer", timeout_s=1.0, unsent_error=KafkaError("producer replaced"))
        fail_unsent_batches(old, KafkaError("producer replaced"))
        await asyncio.sleep(0)  # let those failure callbacks run before anything new is sent
        while True:
            self._producer = AIOKafkaProducer(**self._producer_kwargs)
            try:
                await self._producer.start()
                break
            except KafkaError as exc:
                log.warning("cannot start a new producer (%r); retrying in %.1fs", exc, self.retry_backoff_s)
                await self._producer.stop()
                await asyncio.sleep(self.retry_backoff_s)
        log.warning("replaced the producer (%d so far)", self.num_producer_resets)

    def _undeliverable(self, record: _BufferedRecord, code: str, message: str) -> None:
        """A record that can never be delivered where it is addressed (resending it fails the same way). Its
        `on_failed` answers elsewhere; without one it is dropped, and its acknowledgement callback still runs:
        an offset waiting on a record that will never land would hold its partition's commits back for good."""
        topic, key, value, on_acked, _, on_failed = record
        self.num_undeliverable += 1
        self.on_dropped(topic)
        try:
            if on_failed is not None:
                on_failed(code, message, on_acked)
            else:
                self.num_dropped_records += 1
                log.debug("a %d-byte record for %s dropped: %s", len(value), topic, message)
                on_acked()
        except Exception:  # a bookkeeping bug must not break the producer's callbacks
            log.exception("undeliverable-record callback failed")
        self._settle([record])

    def has_unsettled(self, key: bytes | None) -> bool:
        """Whether a record with this key is published but not yet settled (acknowledged, or answered
        elsewhere). Needs `track_settled` set before those records were published."""
        return key in self._unsettled_keys

    def _settle(self, records: list[_BufferedRecord]) -> None:
        if self.track_settled:
            keys = self._unsettled_keys
            for record in records:
                left = keys.get(record[1], 0) - 1
                if left > 0:
                    keys[record[1]] = left
                else:
                    keys.pop(record[1], None)
        self._num_unacked -= len(records)
        if self._num_unacked == 0:
            self._idle.set()
