"""The gateway's one Kafka client: its own reply topic, the status board (429 before anything is produced), and
request submission. Built on the Python client (producer_examples/client.py), as any producer would be; it never
imports the worker's engine.

Answers are routed by topic, not filtered by id: each gateway instance creates a reply topic of its own,
`GATEWAY_REPLY_TOPIC_PREFIX` + instance id, names it in every request it sends, and reads only that topic (and
the status topic). The workers allow it by prefix (`KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES`), so adding an instance
needs no change to the workers, and no instance reads another's answers. An instance with a random id deletes
its topic when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from producer_examples.client import BackoffPolicy, LLMClient, RequestHandle
from schemas.request import GenerationRequest
from worker.config import GatewaySettings, KafkaSettings

log = logging.getLogger(__name__)

STATUS_MAX_AGE_S = 5.0
"""Status records older than this say nothing (a dead worker must not keep a priority refused)."""
MAX_RETRY_AFTER_S = 60
TOPIC_READY_S = 15.0


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
        log.info("gateway %s reads its answers on %s", self.instance_id, self.reply_topic)

    async def stop(self) -> None:
        await self.client.stop()
        if self.ephemeral:
            await self._delete_reply_topic()

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

    async def submit(self, request: GenerationRequest, priority: int, wait_s: float | None = None,
                     headers: list[tuple[str, bytes]] | None = None) -> RequestHandle:
        return await self.client.submit(request, priority, timeout_s=wait_s, headers=headers)
