"""Where records may go: whether a topic exists, whether the worker may write it, how large a record it takes.

The publisher asks before it hands a record to the producer. A record for a topic that is missing never
enters the producer: aiokafka would wait for the topic's metadata up to its request timeout at every try,
logging an ERROR at every metadata update, and an idempotent producer never expires a batch, so a batch for
a deleted topic retries forever and holds back every later record of its partition, and through them the
request offsets that wait on those records. Instead the topic is looked up in the background, for at most
`wait_s`, while records for every other topic go on; a topic that a broker says is absent after that is
unavailable for `recheck_s`, and its records are answered elsewhere (publisher.py).

"Absent" needs an answer from a broker: while no broker answers (a restart), a topic is neither available
nor unavailable, and its records wait, as every other record does then.

The record limit is the topic's `max.message.bytes` as the broker reports it (DescribeConfigs), not an
assumed 1 MB: a record batch larger than it is refused as a whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from worker.transport.kafka.aiokafka_compat import describe_topic_max_message_bytes

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
"""The broker's default `message.max.bytes`: used when a topic's own limit cannot be read."""
RECORD_OVERHEAD_BYTES = 128
"""A record batch's header (61 bytes) and one record's framing, with room to spare."""
MAX_TOPICS = 1024
"""Topics whose state is kept: with reply topics allowed by a prefix, requests may name any number of distinct
topics, and each would otherwise stay known for good. Past it the least recently set states are forgotten (a
forgotten topic is looked up again at its next record)."""


@dataclass(slots=True, frozen=True)
class TopicState:
    available: bool
    checked_at: float
    message: str = ""
    """Why the topic is unavailable: one line that names the cause."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def record_size(key: bytes | None, value: bytes) -> int:
    """What a record adds to a batch, framing included: what a topic's record limit is compared with."""
    return len(value) + len(key or b"") + RECORD_OVERHEAD_BYTES


def record_problem(state: TopicState, topic: str, key: bytes | None, value: bytes,
                   max_request_size: int | None = None) -> tuple[str, str] | None:
    """Why a record cannot go to a topic in this state, as (reason code, message); None when it can."""
    if not state.available:
        return "reply_topic_unavailable", state.message
    limit = state.max_message_bytes if max_request_size is None else min(state.max_message_bytes, max_request_size)
    if record_size(key, value) > limit:
        return "result_too_large", (f"a {len(value)}-byte record exceeds the {limit}-byte record limit of topic "
                                    f"{topic!r} (max.message.bytes)")
    return None


class Destinations:
    """What is known of each destination topic; `resolve` looks one up in the background."""

    def __init__(
        self,
        probe: BrokerProbe,
        wait_s: float = 5.0,
        recheck_s: float = 10.0,
        refresh_s: float = 300.0,
        on_change: Callable[[str, TopicState], None] = lambda topic, state: None,
    ) -> None:
        self.probe = probe
        self.wait_s = wait_s
        """How long a topic may be absent from a broker's metadata before its records are answered elsewhere."""
        self.recheck_s = recheck_s
        """How long an unavailable topic stays so before it is looked up again."""
        self.refresh_s = refresh_s
        """How long an available topic's state (its record limit) is trusted before it is read again."""
        self.on_change = on_change
        """Called when a topic becomes available or unavailable (a log line and a metric, not one per record)."""
        self._states: dict[str, TopicState] = {}
        self._checks: dict[str, asyncio.Task] = {}

    def state(self, topic: str) -> TopicState | None:
        """The topic's known state, or None while it is unknown or stale (call `resolve`)."""
        state = self._states.get(topic)
        if state is None:
            return None
        age = time.monotonic() - state.checked_at
        if age > (self.refresh_s if state.available else self.recheck_s):
            return None
        return state

    @property
    def num_checking(self) -> int:
        return len(self._checks)

    def unavailable_topics(self) -> dict[str, str]:
        """Topics known to be unavailable now, with why."""
        return {t: s.message for t, s in self._states.items() if not s.available and self.state(t) is not None}

    def resolve(self, topic: str, on_done: Callable[[], None] = lambda: None) -> None:
        """Look the topic up in the background (once at a time per topic); `on_done` runs when it is known."""
        running = self._checks.get(topic)
        if running is not None:
            running.add_done_callback(lambda _: on_done())
            return
        task = asyncio.ensure_future(self._check(topic))
        self._checks[topic] = task
        task.add_done_callback(lambda _: self._checks.pop(topic, None))
        task.add_done_callback(lambda _: on_done())

    def mark_unavailable(self, topic: str, message: str) -> None:
        """A broker refused a write to the topic (not authorized, unknown): unavailable for `recheck_s`."""
        self._set(topic, TopicState(False, time.monotonic(), message))

    def forget(self, topic: str) -> None:
        """Look the topic up again before the next record for it (its partitions or limit may have changed)."""
        self._states.pop(topic, None)

    async def stop(self) -> None:
        for task in list(self._checks.values()):
            task.cancel()
        await asyncio.gather(*self._checks.values(), return_exceptions=True)
        await self.probe.close()

    async def _check(self, topic: str) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                present = topic in await self.probe.topics()
            except (KafkaError, OSError, asyncio.TimeoutError) as exc:
                # No broker answered: nothing is known, so nothing is declared; wait with everyone else.
                log.debug("metadata for %s not fetched (%r); retrying", topic, exc)
                await asyncio.sleep(0.5)
                deadline = time.monotonic() + self.wait_s
                continue
            if present:
                limit = None
                try:
                    limit = await self.probe.max_message_bytes(topic)
                except Exception as exc:  # noqa: BLE001 - the default limit serves; the topic is there all the same
                    log.warning("max.message.bytes of %s not read (%r); assuming %d", topic, exc,
                                DEFAULT_MAX_MESSAGE_BYTES)
                self._set(topic, TopicState(True, time.monotonic(),
                                            max_message_bytes=limit or DEFAULT_MAX_MESSAGE_BYTES))
                return
            if time.monotonic() >= deadline:
                self._set(topic, TopicState(False, time.monotonic(), (
                    f"topic {topic!r} does not exist (or this worker may not describe it): absent from the "
                    f"broker's metadata for {self.wait_s:g} s")))
                return
            await asyncio.sleep(min(0.5, max(0.05, deadline - time.monotonic())))

    def _set(self, topic: str, state: TopicState) -> None:
        before = self._states.pop(topic, None)
        self._states[topic] = state  # at the end: the dict's order is the order states were set
        while len(self._states) > MAX_TOPICS:
            del self._states[next(iter(self._states))]
        if before is None or before.available != state.available:
            self.on_change(topic, state)


class BrokerProbe:
    """Asks the broker what `Destinations` needs: the topics it lists, and a topic's record limit."""

    def __init__(self, metadata_client: Callable[[], object], admin_kwargs: dict) -> None:
        self._metadata_client = metadata_client
        """The producer's client (the producer may be replaced, hence a callable)."""
        self._admin_kwargs = admin_kwargs
        self._admin: AIOKafkaAdminClient | None = None
        self._admin_lock = asyncio.Lock()
        """Topics are checked concurrently: without it each would start an admin client of its own and all but
        the last would never be closed (their metadata tasks polling the broker for the life of the process)."""

    async def topics(self) -> set[str]:
        """Every topic a broker lists for this principal, from a fresh metadata request (raises when none
        answers). A request for all topics never creates one, whatever auto.create.topics.enable says."""
        metadata = await asyncio.wait_for(self._metadata_client().fetch_all_metadata(), 10.0)
        return set(metadata.topics())

    async def max_message_bytes(self, topic: str) -> int | None:
        async with self._admin_lock:
            if self._admin is None:
                admin = AIOKafkaAdminClient(**self._admin_kwargs)
                try:
                    await asyncio.wait_for(admin.start(), 10.0)
                except BaseException:
                    await admin.close()  # a half-started client polls the broker until closed
                    raise
                self._admin = admin
            admin = self._admin
        return await asyncio.wait_for(describe_topic_max_message_bytes(admin, topic), 10.0)

    async def close(self) -> None:
        async with self._admin_lock:
            if self._admin is not None:
                admin, self._admin = self._admin, None
                await admin.close()
