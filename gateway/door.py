"""The gateway's one Kafka client: its own reply topic, the status board (429 before anything is produced), and
request submission. Built on the Python client (the llm_client package), as any producer would be; it never
imports the worker's engine.

Answers are routed by topic, not filtered by id: each gateway instance creates a reply topic of its own,
`GATEWAY_REPLY_TOPIC_PREFIX` + instance id, names it in every request it sends, and reads only that topic (and
the status topic). The workers allow it by prefix (`KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES`), so adding an instance
needs no change to the workers, and no instance reads another's answers.

Reply topics do not leak. A stable instance id (GATEWAY_INSTANCE_ID, a StatefulSet's pod name) reuses its
topic after a restart. A random one is deleted when its instance stops, and expires when it crashes: while it
runs, an instance commits a heartbeat every quarter of its GATEWAY_REPLY_SWEEP_S (offset metadata of a group
named after its topic, saying until when it holds: three beats), and every instance now and then deletes the
random-id topics of its prefix whose heartbeat has expired, or is absent at two sweeps running. Only names a
gateway makes at random are swept, so a topic someone named under the prefix is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import uuid

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from worker.kafka_stop import stop_client
from llm_client import BackoffPolicy, LLMClient, RequestHandle
from schemas.request import GenerationRequest
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings

log = logging.getLogger(__name__)

STATUS_MAX_AGE_S = 5.0
"""Status records older than this say nothing (a dead worker must not keep a priority refused)."""
MAX_RETRY_AFTER_S = 60
TOPIC_READY_S = 15.0
RANDOM_ID = re.compile(r"^(gw|batch)-[0-9a-f]{10}$")
"""The instance ids a Door makes up; only their topics are swept."""
HEARTBEAT = "alive-until@"
BEATS_HELD = 3
"""A heartbeat holds for this many beats: one missed beat (a slow broker) does not expire a live instance."""


def heartbeat_ms(offsets: dict) -> int | None:
    """Until when (epoch ms) the newest heartbeat among a group's committed offsets (their metadata) holds."""
    newest = None
    for meta in offsets.values():
        text = getattr(meta, "metadata", "") or ""
        if text.startswith(HEARTBEAT) and text[len(HEARTBEAT):].isdigit():
            newest = max(newest or 0, int(text[len(HEARTBEAT):]))
    return newest


class Door:
    def __init__(self, kafka: KafkaSettings, settings: GatewaySettings, kind: str = "gw") -> None:
        """kind: the start of a random instance id (`gw` for a gateway, `batch` for `llm-worker batch run`)."""
        self.kafka = kafka
        self.settings = settings
        self.ephemeral = not settings.instance_id
        self.instance_id = settings.instance_id or f"{kind}-{uuid.uuid4().hex[:10]}"
        self.reply_topic = settings.reply_topic_prefix + self.instance_id
        # No client-side backoff: an interactive caller gets 429 with Retry-After instead of a silent wait.
        self.client = LLMClient(kafka, reply_topic=self.reply_topic, backoff=BackoffPolicy(enabled=False),
                                default_timeout_s=settings.request_wait_s)
        self._presence: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task] = []
        self._idle_before: set[str] = set()
        self.num_swept = 0

    @property
    def num_priorities(self) -> int:
        return self.kafka.num_priorities

    @property
    def bulk_priority(self) -> int:
        return self.num_priorities - 1 if self.settings.batch_priority < 0 else \
            min(self.settings.batch_priority, self.num_priorities - 1)

    async def start(self) -> None:
        await self._ensure_reply_topic()
        await self.client.start()
        if self.ephemeral:
            await self._hold_presence()
        if self.settings.reply_sweep_s > 0:
            self._tasks.append(asyncio.create_task(self._sweep_every(self.settings.reply_sweep_s),
                                                   name="reply-topic-sweep"))
        log.info("gateway %s reads its answers on %s", self.instance_id, self.reply_topic)
        mismatch = self.reply_topic_refusal()  # the status topic was read up to date by client.start()
        if mismatch is not None:
            log.error("requests will be refused with 503: %s", mismatch)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.client.stop()
        if self._presence is not None:
            await stop_client(self._presence, "gateway's reply-topic presence")
            self._presence = None
        if self.ephemeral:
            await self._delete_reply_topic()

    async def _hold_presence(self) -> None:
        """Heartbeats for this instance's reply topic: a commit with the time in its metadata, which a sweep
        reads. A plain commit (no group membership): nothing is assigned, fetched or rebalanced."""
        consumer = AIOKafkaConsumer(**self.kafka.client_kwargs(), group_id=self.reply_topic,
                                    enable_auto_commit=False)
        await consumer.start()
        tp = TopicPartition(self.reply_topic, 0)
        consumer.assign([tp])
        self._presence = consumer
        interval_s = max(0.25, self.settings.reply_sweep_s / 4) if self.settings.reply_sweep_s > 0 else 60.0

        async def beat() -> None:
            while True:
                try:
                    until_ms = int((time.time() + BEATS_HELD * interval_s) * 1000)
                    await consumer.commit({tp: OffsetAndMetadata(0, f"{HEARTBEAT}{until_ms}")})
                except Exception as exc:  # noqa: BLE001 - a broker away for a while; the next beat says it
                    log.debug("heartbeat of %s: %r", self.reply_topic, exc)
                await asyncio.sleep(interval_s)

        self._tasks.append(asyncio.create_task(beat(), name="reply-topic-heartbeat"))

    async def _sweep_every(self, interval_s: float) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - a leftover topic costs disk, not correctness
                log.warning("sweeping reply topics under %s: %r", self.settings.reply_topic_prefix, exc)
            await asyncio.sleep(interval_s)

    async def sweep(self) -> list[str]:
        """Deletes the random-id reply topics of this prefix whose instance is gone: its heartbeat expired, or
        there is none at this sweep and the last one (a sweep alone could catch an instance between creating
        its topic and its first heartbeat). Each heartbeat says how long it holds: instances of one prefix
        may sweep at different intervals."""
        prefix = self.settings.reply_topic_prefix
        admin = await self._admin()
        try:
            topics = [t for t in await admin.list_topics()
                      if t.startswith(prefix) and t != self.reply_topic and RANDOM_ID.match(t[len(prefix):])]
            now_ms = time.time() * 1000
            silent, stale = set(), set()
            for topic in topics:
                until_ms = heartbeat_ms(await admin.list_consumer_group_offsets(topic))
                if until_ms is None:
                    silent.add(topic)
                elif now_ms > until_ms:
                    stale.add(topic)
            doomed = sorted(stale | (silent & self._idle_before))
            self._idle_before = silent - set(doomed)
            if doomed:
                await admin.delete_topics(doomed)
                self.num_swept += len(doomed)
                log.info("deleted %d reply topics of instances gone: %s", len(doomed), ", ".join(doomed))
            return doomed
        finally:
            await admin.close()

    async def _admin(self) -> AIOKafkaAdminClient:
        admin = AIOKafkaAdminClient(**self.kafka.client_kwargs())
        await admin.start()
        return admin

    async def _ensure_reply_topic(self) -> None:
        admin = await self._admin()
        try:
            if self.reply_topic in set(await admin.list_topics()):
                return
            spec = NewTopic(self.reply_topic, self.settings.reply_topic_partitions, self.kafka.replication_factor,
                            topic_configs={"retention.ms": str(self.kafka.result_retention_ms)})
            response = await admin.create_topics([spec])
            for topic_error in response.topic_errors:
                name, code = topic_error[0], topic_error[1]
                if code not in (0, TopicAlreadyExistsError.errno):
                    raise for_code(code)(f"cannot create reply topic {name}: {topic_error[2]}")
            # Created is not yet known to every broker: the client below looks it up in the metadata.
            deadline = time.monotonic() + TOPIC_READY_S
            while self.reply_topic not in set(await admin.list_topics()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reply topic {self.reply_topic} not in the metadata after {TOPIC_READY_S} s")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()

    async def _delete_reply_topic(self) -> None:
        try:
            admin = await self._admin()
            try:
                await admin.delete_topics([self.reply_topic])
            finally:
                await admin.close()
        except Exception as exc:  # noqa: BLE001 - a leftover topic costs disk, not correctness
            log.warning("could not delete reply topic %s: %r", self.reply_topic, exc)

    def reply_topic_refusal(self) -> str | None:
        """Why requests would not be answered here, naming the settings to change: a fresh worker report says its
        worker does not answer on this instance's reply topic (it would answer on the result topic, which a
        gateway does not read, and the caller would wait for nothing). None when every reporting worker allows
        it, or none reports."""
        topic = self.reply_topic
        refusing = self.client.board.refusing_reply_topic(topic, STATUS_MAX_AGE_S)
        if not refusing:
            return None
        prefixes = sorted({prefix for status in refusing for prefix in status.allowed_reply_topic_prefixes})
        return (f"worker {refusing[0].worker_id} (and {len(refusing) - 1} more) does not answer on this gateway's "
                f"reply topic {topic}: add {self.settings.reply_topic_prefix!r} to the workers' "
                f"KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES (now {prefixes}), or set GATEWAY_REPLY_TOPIC_PREFIX to one "
                "of those")

    def refusal(self, priority: int) -> tuple[str, int] | None:
        """(why, Retry-After seconds) while a fresh status report says `priority` is shed or paused, else None.

        Retry-After: a shed priority's estimated wait as the shedding worker reports it (the backlog it must
        work off first), within 1..60 s; a paused one, 1 s (workers report every second, and a pause lifts as
        soon as their local queue drains below its low watermark)."""
        why = self.client.board.congestion(priority, STATUS_MAX_AGE_S)
        if why is None:
            return None
        retry_s = 1.0
        for status in self.client.board.fresh(STATUS_MAX_AGE_S):
            for entry in status.priorities:
                if entry.priority == priority and entry.shed and entry.est_wait_s is not None:
                    retry_s = max(retry_s, entry.est_wait_s)
        return why, min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_s)))

    def adapters(self) -> list[str]:
        """The LoRA adapters that the workers reporting lately serve (their status records), sorted."""
        return sorted({name for status in self.client.board.fresh(STATUS_MAX_AGE_S) for name in status.adapters or ()})

    async def submit(self, request: GenerationRequest, priority: int, wait_s: float | None = None,
                     headers: list[tuple[str, bytes]] | None = None) -> RequestHandle:
        return await self.client.submit(request, priority, timeout_s=wait_s, headers=headers)
