"""An asyncio client for the worker: submit a request by priority, stream its chunks, await its final record.

Needs only aiokafka and `schemas` (plus KafkaSettings for names and connection options); no torch.

    async with LLMClient(KafkaSettings()) as client:
        handle = await client.submit(GenerationRequest(id="r1", prompt="Hi"), priority=1)
        async for delta in handle.stream():
            print(delta.text, end="", flush=True)
        final = await handle.result()

One consumer serves every request of the client. It is assigned all partitions of the reply topic (no
consumer group: each client reads everything and keeps the ids it asked for) and of the status topic. At
start it moves to the end of the reply topic and waits until that position is resolved, *before* any request
can be sent, so no answer can slip in between "send" and "start reading". The status topic is read from a
little way back (`status_lookback`), so the current load is known from the first submit on (backoff.py).

Cancelling: `await handle.cancel()` (or `client.cancel(request_id)` for any id) writes a cancel record to the
control topic; the request then ends with a `cancelled` final holding the text so far. With
`cancel_on_abandon` (the default) a task cancelled while it waits in `stream()` or `result()` sends one too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from worker.kafka_stop import stop_client
from schemas.control import CancelRecord
from schemas.decode import decode_result, decode_status, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from schemas.status import WorkerStatus
from worker.kafka_settings import KafkaSettings
from llm_client.backoff import BackoffPolicy, StatusBoard, wait_while_congested
from llm_client.handle import ClientError, Delta, RequestHandle, RequestTimeout, StreamGap, wait_event

log = logging.getLogger(__name__)

__all__ = ["BackoffPolicy", "ClientError", "Delta", "LLMClient", "RequestHandle", "RequestTimeout", "StreamGap"]

DEADLINE_GRACE_S = 10.0
"""Past a request's deadline the worker still owes a `rejected`/`deadline` final; wait this much for it."""
CANCEL_FLUSH_S = 5.0
"""stop() waits this long for cancel records still being sent."""


class LLMClient:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        backoff: BackoffPolicy = BackoffPolicy(),
        default_timeout_s: float = 120.0,
        reply_topic: str | None = None,
        status_lookback: int = 50,
        status_sync_timeout_s: float = 3.0,
        cancel_on_abandon: bool = True,
    ) -> None:
        """reply_topic: read answers there instead of the result topic (the worker must allow it);
        status_lookback: status records per partition read back at start;
        status_sync_timeout_s: how long start waits to have read them;
        cancel_on_abandon: when a task waiting in a handle's stream() or result() is cancelled (Ctrl-C under
        asyncio.run, asyncio.wait_for running out, task.cancel()) before the final arrived, send a cancel for
        the request (see cancel())."""
        self.settings = settings
        self.backoff = backoff
        self.default_timeout_s = default_timeout_s
        self.reply_topic = reply_topic
        self.status_lookback = status_lookback
        self.status_sync_timeout_s = status_sync_timeout_s
        self.cancel_on_abandon = cancel_on_abandon
        self._control_topic_known = False
        self._cancels_in_flight: set[asyncio.Task] = set()
        self.board = StatusBoard(settings.num_request_partitions, settings.num_priorities)
        self.num_undecodable = 0
        self.num_records = 0
        self._handles: dict[str, RequestHandle] = {}
        self._status_listeners: list[Callable[[WorkerStatus], None]] = []
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self._status_synced = asyncio.Event()
        self._status_targets: dict[TopicPartition, int] = {}

    @property
    def result_topic(self) -> str:
        return self.reply_topic or self.settings.result_topic

    # -- lifecycle -------------------------------------------------------------------------------------
    async def __aenter__(self) -> "LLMClient":
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def start(self) -> None:
        kwargs = self.settings.client_kwargs()
        self._producer = AIOKafkaProducer(**kwargs, enable_idempotence=True, acks="all", linger_ms=2)
        # With exactly-once finals, only committed transactions count: a final of an aborted one (a zombie's,
        # or one written before a crash) is never read.
        isolation = "read_committed" if self.settings.exactly_once else "read_uncommitted"
        self._consumer = AIOKafkaConsumer(**kwargs, group_id=None, enable_auto_commit=False,
                                          auto_offset_reset="latest", isolation_level=isolation)
        try:
            await self._producer.start()
            await self._consumer.start()
            await self._check_request_topic()
            result_tps = await self._partitions(self.result_topic)
            status_tps = await self._partitions(self.settings.status_topic)
            self._consumer.assign(result_tps + status_tps)
            await self._consumer.seek_to_end(*result_tps)
            for tp in result_tps:
                # position() blocks until the "end" is an actual offset; only then may requests go out.
                await self._consumer.position(tp)
            await self._seek_status_back(status_tps)
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._consume(), name="llm-client-consumer")
        if not await wait_event(self._status_synced, self.status_sync_timeout_s):
            log.warning("status topic not read up to date within %.1f s; starting without it",
                        self.status_sync_timeout_s)

    async def stop(self) -> None:
        if self._cancels_in_flight:  # cancels sent for abandoned requests: let them reach Kafka first
            await asyncio.wait(set(self._cancels_in_flight), timeout=CANCEL_FLUSH_S)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for client in (self._consumer, self._producer):
            if client is not None:
                await stop_client(client, "client")
        self._consumer = self._producer = None

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        # One metadata request for all topics: asking for a missing topic by name would retry for 40 s.
        if topic not in await self._consumer.topics():
            raise ClientError(f"topic {topic} does not exist on {self.settings.bootstrap_servers}; "
                              "create it with `llm-worker topics`")
        return [TopicPartition(topic, p) for p in sorted(await self._producer.partitions_for(topic))]

    async def _check_request_topic(self) -> None:
        num_partitions = len(await self._partitions(self.settings.request_topic))
        if num_partitions < self.settings.num_request_partitions:
            # The workers map partitions to priorities with the configured count: writing past the real
            # count would fail, and writing within it to the wrong priority would be silent.
            raise ClientError(
                f"{self.settings.request_topic} has {num_partitions} partitions, the settings expect "
                f"{self.settings.num_request_partitions} ({self.settings.num_priorities} priorities x "
                f"{self.settings.partitions_per_priority})")

    async def _seek_status_back(self, status_tps: list[TopicPartition]) -> None:
        beginnings = await self._consumer.beginning_offsets(status_tps)
        ends = await self._consumer.end_offsets(status_tps)
        for tp in status_tps:
            self._consumer.seek(tp, max(beginnings[tp], ends[tp] - self.status_lookback))
        self._status_targets = {tp: ends[tp] for tp in status_tps if ends[tp] > beginnings[tp]}
        if not self._status_targets:
            self._status_synced.set()

    # -- the shared consumer ---------------------------------------------------------------------------
    async def _consume(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=200, max_records=1000)
                backoff_s = 0.1
            except KafkaError as exc:
                log.warning("result consumer: %r; retrying in %.1f s", exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
                continue
            for tp, messages in batches.items():
                for message in messages:
                    self.num_records += 1
                    if tp.topic == self.settings.status_topic:
                        self._on_status(message.value)
                    else:
                        self._on_result(message.value)
                if tp in self._status_targets and messages and messages[-1].offset + 1 >= self._status_targets[tp]:
                    del self._status_targets[tp]
                    if not self._status_targets:
                        self._status_synced.set()

    def _on_result(self, value: bytes | None) -> None:
        try:
            record = decode_result(value or b"")
        except msgspec.DecodeError as exc:
            self.num_undecodable += 1
            log.warning("undecodable record on %s: %s", self.result_topic, exc)
            return
        handle = self._handles.get(record.id)
        if handle is None:
            return  # another client's request, one already answered, or one closed after a timeout
        handle.feed(record)
        if handle.done:
            # Later records of this id (a redelivery after the worker published the final but died before
            # committing) repeat an answered request; forgetting the handle drops them.
            del self._handles[record.id]

    def _on_status(self, value: bytes | None) -> None:
        try:
            status = decode_status(value or b"")
        except msgspec.DecodeError as exc:
            self.num_undecodable += 1
            log.warning("undecodable status record: %s", exc)
            return
        self.board.update(status)
        for listener in self._status_listeners:
            listener(status)

    def add_status_listener(self, listener: Callable[[WorkerStatus], None]) -> None:
        """Call listener with every status record read (including the look-back at start)."""
        self._status_listeners.append(listener)

    # -- submitting ------------------------------------------------------------------------------------
    async def submit(
        self,
        request: GenerationRequest,
        priority: int,
        *,
        timeout_s: float | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> RequestHandle:
        """Send a request to a partition of `priority` (key = request id; the partition is chosen by its session id
        when it has one, else its id: schemas.priority); returns once Kafka acknowledged it.

        headers: Kafka headers of the request record (a W3C `traceparent` continues the caller's trace).
        timeout_s: default wait of the handle's stream() and result(), from now. Unset, it is the request's
        own deadline plus DEADLINE_GRACE_S, or the client's default_timeout_s when the request has none.
        Before sending, waits (bounded) while a worker reports this priority congested; see backoff.py. A
        request with timeout_ms is sent with the time it waited taken off, so its deadline stays where the
        caller put it (the worker counts timeout_ms from the record's timestamp, which comes after the wait).
        """
        if self._producer is None:
            raise ClientError("the client is not started (use `async with LLMClient(...)`)")
        if not 0 <= priority < self.settings.num_priorities:
            raise ValueError(f"priority {priority} is outside 0..{self.settings.num_priorities - 1}")
        if request.id in self._handles:
            raise ClientError(f"request id {request.id} is already in flight on this client")
        if self.reply_topic is not None and request.reply_topic != self.reply_topic:
            request = msgspec.structs.replace(request, reply_topic=self.reply_topic)
        if self.reply_topic is not None:
            refusing = self.board.refusing_reply_topic(self.reply_topic, self.backoff.status_max_age_s)
            if refusing:
                # Answered on the result topic, which this client does not read: it would wait for nothing.
                raise ClientError(
                    f"worker {refusing[0].worker_id} does not answer on reply topic {self.reply_topic}: add it (or a "
                    "prefix of it) to the workers' KAFKA_ALLOWED_REPLY_TOPICS / KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES")
        if request.priority != priority:
            request = msgspec.structs.replace(request, priority=priority)
        deadline_at = self._deadline_at(request)
        if timeout_s is None:
            timeout_s = (self.default_timeout_s if deadline_at is None
                         else max(0.0, deadline_at - time.monotonic()) + DEADLINE_GRACE_S)
        partition = partition_for(priority, request.routing_key, self.settings.num_request_partitions,
                                  self.settings.num_priorities)
        handle = RequestHandle(request.id, priority, partition, timeout_s, self._forget,
                               send_cancel=self.cancel_later, cancel_on_abandon=self.cancel_on_abandon)
        # Registered before sending: the answer may arrive before send_and_wait returns.
        self._handles[request.id] = handle
        try:
            handle.backoff_s = await wait_while_congested(self.board, self.backoff, priority, deadline_at)
            if handle.backoff_s > 0 and request.timeout_ms is not None:
                left_ms = max(1, request.timeout_ms - round(handle.backoff_s * 1000))
                request = msgspec.structs.replace(request, timeout_ms=left_ms)
            await self._producer.send_and_wait(self.settings.request_topic, encode(request),
                                               key=request.id.encode(), partition=partition, headers=headers)
        except BaseException:
            self._handles.pop(request.id, None)
            raise
        handle.sent_at = time.monotonic()
        return handle

    @staticmethod
    def _deadline_at(request: GenerationRequest) -> float | None:
        """The request's deadline as time.monotonic() seconds (timeout_ms counts from about now)."""
        now_ms = time.time() * 1000.0
        deadline_ms = request.deadline_at_ms(int(now_ms))
        return None if deadline_ms is None else time.monotonic() + (deadline_ms - now_ms) / 1000.0

    async def cancel(self, request_id: str, reason: str = "") -> None:
        """Cancel a request sent by anyone: a CancelRecord on the control topic, key = request id; returns once
        Kafka acknowledged it. Whichever worker holds the request stops it within one engine step and answers
        it with a `cancelled` final (the text so far, its usage); a worker that reads the request later answers
        it `cancelled` at once. An unknown or finished id is harmless. (`RequestHandle.cancel` does this for a
        request of this client.)"""
        if self._producer is None:
            raise ClientError("the client is not started (use `async with LLMClient(...)`)")
        topic = self.settings.control_topic
        if not self._control_topic_known:
            if topic not in await self._consumer.topics():
                raise ClientError(f"topic {topic} does not exist on {self.settings.bootstrap_servers}; "
                                  "create it with `llm-worker topics`")
            self._control_topic_known = True
        await self._producer.send_and_wait(topic, encode(CancelRecord(id=request_id, reason=reason)),
                                           key=request_id.encode())

    def cancel_later(self, request_id: str, reason: str) -> asyncio.Task:
        """cancel() as a task the client keeps (stop() lets it finish): a handle's cancel survives the
        cancellation of the task that asked for it, and one sent while the broker is away goes once it is back."""
        task = asyncio.ensure_future(self.cancel(request_id, reason))
        self._cancels_in_flight.add(task)

        def done(task: asyncio.Task) -> None:
            self._cancels_in_flight.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("cancel of %s not sent: %r", request_id, task.exception())

        task.add_done_callback(done)
        return task

    def _forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet answered (nor closed)."""
        return len(self._handles)

    def congestion(self, priority: int) -> str | None:
        """Why `priority` is congested per the latest fresh status reports, or None."""
        return self.board.congestion(priority, self.backoff.status_max_age_s)
