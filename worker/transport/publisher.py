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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from worker.transport.aiokafka_compat import fail_unsent_batches

log = logging.getLogger(__name__)

Record = tuple[str, bytes | None, bytes]
"""(topic, key, value)"""
_BufferedRecord = tuple[str, bytes | None, bytes, Callable[[], None], int]
"""(topic, key, value, on_acked, sequence number that restores publish order after a failure)"""

MAX_BUFFERED = 50_000
"""Records waiting for the flusher above which `publish` waits: bounds memory while the broker is away."""
PARTITIONS_TTL_S = 30.0
KEY_PARTITIONS_MAX = 100_000
"""Keys whose partition is remembered (a request's id while it streams); the memory is cleared when full."""


def _nothing() -> None:
    pass


class Publisher:
    def __init__(self, client_kwargs: dict, max_request_size: int = 4 * 1024 * 1024, linger_ms: int = 2,
                 on_dropped: Callable[[str], None] = lambda topic: None,
                 gather_s: Callable[[], float] = lambda: 0.0) -> None:
        self._producer_kwargs = dict(
            **client_kwargs, enable_idempotence=True, acks="all", linger_ms=linger_ms,
            max_request_size=max_request_size, max_batch_size=256 * 1024,
        )
        self._producer = AIOKafkaProducer(**self._producer_kwargs)
        self._needs_new_producer = False
        self._seq = 0
        self.num_producer_resets = 0
        self.num_dropped_records = 0
        self.num_batches_sent = 0
        self.on_dropped = on_dropped
        """Called with the topic of each record dropped as undeliverable (a metric)."""
        self.gather_s = gather_s
        """How long the flusher lets records gather after the first one wakes it (worker.io_gather_s)."""
        self._partitioner = DefaultPartitioner()
        self._key_partitions: dict[tuple[str, bytes], int] = {}
        self._partitions: dict[str, tuple[float, list[int]]] = {}
        self._buffer: list[_BufferedRecord] = []
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_unacked = 0
        self._flusher: asyncio.Task | None = None
        self.retry_backoff_s = 0.5

    async def start(self) -> None:
        await self._producer.start()
        self._flusher = asyncio.create_task(self._flush_loop())

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        await self._producer.stop()

    @property
    def num_unacked(self) -> int:
        return self._num_unacked

    async def publish(self, topic: str, key: bytes | None, value: bytes, on_acked: Callable[[], None] | None = None) -> None:
        self.publish_nowait(topic, key, value, on_acked)
        await self.wait_room()

    def publish_group_nowait(self, records: list[Record], on_acked: Callable[[], None] | None = None) -> None:
        """Buffer records that answer one thing together: `on_acked` runs once, after the last is acknowledged."""
        remaining = [len(records)]

        def one_acked() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and on_acked is not None:
                on_acked()

        for topic, key, value in records:
            self.publish_nowait(topic, key, value, one_acked)

    def publish_nowait(self, topic: str, key: bytes | None, value: bytes, on_acked: Callable[[], None] | None = None) -> None:
        """Buffer one record; the hot path (no coroutine). Call `wait_room` now and then to bound the buffer."""
        self._num_unacked += 1
        self._seq += 1
        self._buffer.append((topic, key, value, on_acked or _nothing, self._seq))
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

    async def _partition_of(self, topic: str, key: bytes | None) -> int:
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

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            gather = self.gather_s()
            if gather > 0 and len(self._buffer) < MAX_BUFFERED // 2:
                await asyncio.sleep(gather)
            self._wake.clear()
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
                    log.warning("cannot hand records to the producer (%r); retrying in %.1fs", exc, self.retry_backoff_s)
                    await asyncio.sleep(self.retry_backoff_s)

    async def _send(self, records: list[_BufferedRecord]) -> None:
        groups: dict[tuple[str, int], list[_BufferedRecord]] = defaultdict(list)
        for record in records:
            groups[(record[0], await self._partition_of(record[0], record[1]))].append(record)
        handed: set[int] = set()
        try:
            for (topic, partition), group in groups.items():
                start = 0
                while start < len(group):
                    batch = self._producer.create_batch()
                    end = start
                    while end < len(group) and batch.append(key=group[end][1], value=group[end][2], timestamp=None):
                        end += 1
                    if end == start:
                        handed.add(group[start][4])
                        self._drop([group[start]], "does not fit a producer batch")
                        start += 1
                        continue
                    chunk = group[start:end]
                    future = await self._producer.send_batch(batch, topic, partition=partition)
                    self.num_batches_sent += 1
                    handed.update(r[4] for r in chunk)
                    producer_epoch = self.num_producer_resets
                    future.add_done_callback(lambda f, c=chunk, e=producer_epoch: self._on_done(f, c, e))
                    start = end
        except BaseException:
            # Whatever was not handed to the producer goes back, in order; what was handed has its callback.
            self._buffer = sorted([r for r in records if r[4] not in handed] + self._buffer, key=lambda r: r[4])
            raise

    def _on_done(self, future: asyncio.Future, chunk: list[_BufferedRecord], producer_epoch: int) -> None:
        """`producer_epoch`: num_producer_resets when the batch was sent; failures of a producer that was
        already replaced must not replace the new one."""
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, MessageSizeTooLargeError):
            # The broker's message.max.bytes is below the batch: resending the same bytes fails forever. The
            # idempotent producer's sequence now has a gap the broker will not accept: replace it too.
            if producer_epoch == self.num_producer_resets:
                self._needs_new_producer = True
                self._wake.set()
            self._drop(chunk, "refused by the broker as too large")
            return
        elif future.cancelled() or exc is not None:
            if producer_epoch == self.num_producer_resets:
                log.warning("delivery of %d records to %s failed (%r); retrying with a new producer",
                            len(chunk), chunk[0][0], exc)
                self._needs_new_producer = True
            # Failed batches come back in any order; sorting by publish sequence keeps each partition's order.
            self._buffer = sorted(chunk + self._buffer, key=lambda record: record[4])
            self._wake.set()
            return
        else:
            for record in chunk:
                try:
                    record[3]()
                except Exception:  # noqa: BLE001 - a bookkeeping bug must not break the producer's callbacks
                    log.exception("ack callback failed")
        self._settle(len(chunk))

    async def _replace_producer(self) -> None:
        self._needs_new_producer = False
        await asyncio.sleep(self.retry_backoff_s)
        old = self._producer
        self.num_producer_resets += 1
        try:
            await asyncio.wait_for(old.stop(), 10.0)
        except Exception:  # noqa: BLE001 - nothing of the old producer is needed any more
            log.debug("stopping the old producer failed", exc_info=True)
        # A dead sender leaves its batches unresolved; failing them sends their records back to the buffer.
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

    def _drop(self, records: list[_BufferedRecord], why: str) -> None:
        """Records that can never be delivered (resending the same bytes fails the same way). Their
        acknowledgement callbacks still run: an offset waiting on a record that will never land would hold its
        partition's commits back for good. Whoever builds records keeps them under the broker's limits
        (answers.py truncates dead letters), so this is the last resort, counted and logged."""
        self.num_dropped_records += len(records)
        for topic, key, value, on_acked, _ in records:
            log.error("a %d-byte record (key %d bytes) for %s %s; dropped, its request counted as answered",
                      len(value), len(key or b""), topic, why)
            self.on_dropped(topic)
            try:
                on_acked()
            except Exception:  # noqa: BLE001 - a bookkeeping bug must not break the producer's callbacks
                log.exception("ack callback failed")
        self._settle(len(records))

    def _settle(self, num_records: int) -> None:
        self._num_unacked -= num_records
        if self._num_unacked == 0:
            self._idle.set()
