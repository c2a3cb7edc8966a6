"""The control reader: every cancel record of the control topic, into the worker's CancelledIds and its handler.

Every worker reads every partition of the control topic, without a consumer group (a cancel must reach
whichever worker holds its request, and the one that holds it after a rebalance). At start it seeks each
partition to the first record of the last `ttl_s` (offsets_for_times), so a cancel written before the worker
started, before its request was read, or before a rebalance moved the request here, still counts; `synced` is
set once it has read up to the ends it found then (the worker lets intake wait for that a bounded time).

It runs on its own consumer and task: a slow, missing or unreachable control topic never holds up request
intake. Failures are logged and retried with backoff (a topic created later is picked up then); undecodable
records (another kind, a newer version) are counted and skipped. Partitions added to the control topic while
the worker runs are picked up at the next metadata refresh (aiokafka then assigns anew, and the reader reads
every partition again from its start: harmless, since cancels are idempotent and expired ones are skipped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.decode import decode_control
from worker.kafka_settings import KafkaSettings
from worker.transport.requests.cancels import Cancel, CancelledIds

log = logging.getLogger(__name__)

MISSING_TOPIC_RETRY_S = 10.0
ASSIGNMENT_WAIT_S = 10.0


class ControlTopicMissing(RuntimeError):
    pass


class ControlReader:
    def __init__(self, kafka: KafkaSettings, cancels: CancelledIds, on_cancel: Callable[[Cancel], None], *,
                 client_id: str = "llm-worker-control") -> None:
        self.kafka = kafka
        self.topic = kafka.control_topic
        self.cancels = cancels
        self.on_cancel = on_cancel
        self.client_id = client_id
        self.synced = asyncio.Event()
        """Read up to the end the control topic had when the reader (last) started."""
        self.num_records = 0
        self.num_undecodable = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._targets: dict[TopicPartition, int] = {}

    async def run(self) -> None:
        backoff_s = 0.5
        while True:
            try:
                await self._start()
                backoff_s = 0.5
                await self._read()
            except asyncio.CancelledError:
                raise
            except ControlTopicMissing:
                log.warning("control topic %r does not exist: cancels are not read until it does (create it with "
                            "`llm-worker topics`); checking again in %.0f s", self.topic, MISSING_TOPIC_RETRY_S)
                self.synced.set()  # nothing to catch up with: intake need not wait
                await self._close()
                await asyncio.sleep(MISSING_TOPIC_RETRY_S)
            except Exception as exc:  # noqa: BLE001 - the reader must outlive any error; intake never waits on it
                log.warning("control reader: %r; restarting in %.1f s", exc, backoff_s)
                await self._close()
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 10.0)

    async def _start(self) -> None:
        consumer = AIOKafkaConsumer(**self.kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="earliest", client_id=self.client_id)
        self._consumer = consumer
        await consumer.start()
        if self.topic not in await consumer.topics():  # before subscribing, which would wait for it
            raise ControlTopicMissing(self.topic)
        # Subscribed without a group: aiokafka assigns every partition, and new ones as metadata shows them.
        consumer.subscribe([self.topic])
        deadline = time.monotonic() + ASSIGNMENT_WAIT_S
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no partitions of {self.topic!r} assigned within {ASSIGNMENT_WAIT_S:.0f} s")
            await asyncio.sleep(0.02)
        tps = sorted(consumer.assignment())
        since_ms = max(0, int(time.time() * 1000 - self.cancels.ttl_ms))
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, ends[tp] if found.get(tp) is None else found[tp].offset)
        self._targets = {tp: ends[tp] for tp in tps if found.get(tp) is not None and found[tp].offset < ends[tp]}
        log.info("control topic %r: reading %d partitions from %.0f s back (%d records to catch up with)",
                 self.topic, len(tps), self.cancels.ttl_ms / 1000,
                 sum(ends[tp] - found[tp].offset for tp in self._targets))
        if not self._targets:
            self.synced.set()

    async def _read(self) -> None:
        consumer = self._consumer
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            now_ms = time.time() * 1000
            for msgs in batches.values():
                for msg in msgs:
                    self._handle(msg.value, msg.timestamp, now_ms)
            if self._targets:
                for tp, end in list(self._targets.items()):
                    if await consumer.position(tp) >= end:
                        del self._targets[tp]
                if not self._targets:
                    log.info("control topic %r read up to date (%d cancels live)", self.topic, len(self.cancels))
                    self.synced.set()

    def _handle(self, value: bytes | None, timestamp_ms: int, now_ms: float) -> None:
        self.num_records += 1
        try:
            record = decode_control(value or b"")
        except msgspec.DecodeError as exc:
            self.num_undecodable += 1
            log.warning("control topic %r: skipping a record that is not a cancel this worker knows: %s",
                        self.topic, exc)
            return
        cancel = self.cancels.add(record.id, float(timestamp_ms), now_ms, record.reason)
        if cancel is None:
            return  # older than the TTL (read back at start): its request is long answered or forgotten
        try:
            self.on_cancel(cancel)
        except Exception:  # one cancel's failure must not stop the reader
            log.exception("handling the cancel of %s failed", record.id)

    async def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                await consumer.stop()
            except Exception:  # a half-started consumer may fail to stop; nothing to keep
                log.debug("control consumer stop failed", exc_info=True)

    async def stop(self, task: asyncio.Task | None) -> None:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._close()
