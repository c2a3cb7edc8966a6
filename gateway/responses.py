"""Background responses: run after the caller has gone, kept for GATEWAY_RESPONSE_RETENTION_S, answered by any
gateway instance.

Their states live in a compacted Kafka topic (GATEWAY_RESPONSES_TOPIC) keyed by response id: `queued` when
accepted (the answer to the POST waits for Kafka's acknowledgement), `in_progress` once its request is sent,
then the terminal state with the whole response object; a delete or the end of retention writes a tombstone.
Every instance reads the topic from its start at boot and then follows it, holding the states in memory, so a
poll is a dictionary lookup on whichever instance it reaches. Staleness is the instance's lag on the topic
(one fetch, up to 100 ms); a poll for an id not seen yet first catches up with the topic's end, so a client
polling another instance right after its POST still finds its response.

Each response is run by the instance that accepted it, its runner (a name kept in GATEWAY_DATA_DIR, so a
gateway restarted on the same folder is the same runner). Only the runner writes a response's states; a state
carries a version, and an older one never replaces a newer one. A restarted runner resumes what it had not
finished: each attempt has its own request id (`<response id>.<attempt>`), the previous one is cancelled
through the control topic, and the terminal state is written once, by the runner, so a response completes once
from the API's view. Its webhook event is queued after that state is written and again at a restart (the queue
drops an event it has already, webhooks.py), so the event is not lost between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import zlib
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code

from worker.kafka_stop import stop_client
from gateway.door import Door
from gateway.files import not_found
from gateway.openai_api import ApiError
from gateway.responses_api import TERMINAL, ResponseOptions, answer_of, outcome, response_object
from gateway.webhooks import Webhooks
from llm_client import ClientError, RequestTimeout
from schemas.decode import decode_request
from schemas.request import GenerationRequest

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 900_000
"""A state must fit one Kafka record (the producer's 1 MiB default, with room for the headers)."""
RETRIED_REASONS = ("shed", "overloaded", "queue_full")
"""A background request refused for these reasons is sent again after the Retry-After: it has no caller waiting
on a 429, and the load that refused it passes."""
CATCH_UP_S = 2.0
CANCEL_WAIT_S = 5.0
TOPIC_READY_S = 15.0


class Responses:
    def __init__(self, door: Door, root: Path, webhooks: Webhooks, clock=time.time) -> None:
        self.door = door
        self.settings = door.settings
        self.topic = self.settings.responses_topic
        self.root = Path(root) / "responses"
        self.webhooks = webhooks
        self.clock = clock
        self.runner = ""
        self._states: dict[str, dict] = {}
        self._handles: dict[str, object] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        self._slots = asyncio.Semaphore(self.settings.background_concurrency)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tps: list[TopicPartition] = []
        self._read_up_to: dict[TopicPartition, int] = {}
        self._changed = asyncio.Event()
        self._background: list[asyncio.Task] = []
        self.num_finished = 0

    # -- lifecycle --------------------------------------------------------------------------------------
    def _runner_name(self) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "runner"
        if path.exists():
            return path.read_text().strip()
        name = f"runner-{os.urandom(8).hex()}"
        path.write_text(name + "\n")
        return name

    async def start(self) -> None:
        self.runner = await asyncio.to_thread(self._runner_name)
        await self._ensure_topic()
        kwargs = self.door.kafka.client_kwargs()
        # Batches of a megabyte: with the default 16 KB, about ten states fill one, and every send past it waits
        # for the batch ahead to drain (the idempotent producer keeps one in flight per partition).
        self._producer = AIOKafkaProducer(**kwargs, enable_idempotence=True, acks="all", linger_ms=5,
                                          max_request_size=1024 * 1024, max_batch_size=1024 * 1024)
        self._consumer = AIOKafkaConsumer(**kwargs, group_id=None, enable_auto_commit=False,
                                          auto_offset_reset="earliest", fetch_max_wait_ms=100)
        await self._producer.start()
        await self._consumer.start()
        self._tps = [TopicPartition(self.topic, p) for p in sorted(await self._producer.partitions_for(self.topic))]
        self._consumer.assign(self._tps)
        await self._consumer.seek_to_beginning(*self._tps)
        self._read_up_to = {tp: 0 for tp in self._tps}
        self._background.append(asyncio.create_task(self._follow(), name="responses-follow"))
        if not await self._catch_up(timeout_s=120.0):
            raise TimeoutError(f"could not read {self.topic} to its end within 120 s")
        now = self.clock()
        mine = [s for s in self._states.values() if s["runner"] == self.runner]
        for state in mine:
            if state["status"] not in TERMINAL:
                log.info("resuming background response %s (%s)", state["id"], state["status"])
                self._start(state)
            elif now - state.get("ended_at", 0) < self.settings.webhook_retry_s:
                await self._notify(state)
        self._background.append(asyncio.create_task(self._sweep_every(), name="responses-sweep"))
        log.info("%d background responses on %s, %d of them run here (%s)", len(self._states), self.topic,
                 len(mine), self.runner)

    async def stop(self) -> None:
        """The responses running here stay unfinished in the topic; the next start on this folder resumes them."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for client in (self._producer, self._consumer):
            if client is not None:
                await stop_client(client, "responses store")

    async def _ensure_topic(self) -> None:
        admin = AIOKafkaAdminClient(**self.door.kafka.client_kwargs())
        await admin.start()
        try:
            if self.topic in set(await admin.list_topics()):
                return
            # Compacted: the newest state of each response is kept, however old; a tombstone removes one.
            spec = NewTopic(self.topic, self.settings.responses_topic_partitions, self.door.kafka.replication_factor,
                            topic_configs={"cleanup.policy": "compact", "segment.ms": str(3600 * 1000),
                                           "delete.retention.ms": str(24 * 3600 * 1000)})
            response = await admin.create_topics([spec])
            for topic_error in response.topic_errors:
                if topic_error[1] not in (0, TopicAlreadyExistsError.errno):
                    raise for_code(topic_error[1])(f"cannot create {topic_error[0]}: {topic_error[2]}")
            deadline = time.monotonic() + TOPIC_READY_S
            while self.topic not in set(await admin.list_topics()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.topic} not in the metadata after {TOPIC_READY_S} s")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()

    # -- the topic --------------------------------------------------------------------------------------
    async def _follow(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=500, max_records=5000)
                backoff_s = 0.1
            except Exception as exc:  # noqa: BLE001 - a broker away for a while: polls answer what was read
                log.warning("reading %s: %r; retrying in %.1f s", self.topic, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
                continue
            for tp, messages in batches.items():
                for message in messages:
                    self._apply(message.key.decode() if message.key else "", message.value)
                if messages:
                    self._read_up_to[tp] = messages[-1].offset + 1
            self._changed.set()
            self._changed = asyncio.Event()

    def _apply(self, response_id: str, value: bytes | None) -> None:
        if value is None:
            self._states.pop(response_id, None)
            task = self._tasks.get(response_id)
            if task is not None:  # deleted elsewhere while it runs here: its work is not wanted any more
                self._cancel_local(response_id, "response deleted")
            return
        try:
            state = msgspec.json.decode(value)
        except msgspec.DecodeError:
            log.warning("an undecodable record on %s (key %s) is skipped", self.topic, response_id)
            return
        current = self._states.get(response_id)
        if current is None or state.get("version", 0) >= current.get("version", 0):
            self._states[response_id] = state

    async def _catch_up(self, timeout_s: float = CATCH_UP_S) -> bool:
        """Waits until every record on the topic when this was called has been read."""
        ends = await self._consumer.end_offsets(self._tps)
        deadline = time.monotonic() + timeout_s
        while any(self._read_up_to.get(tp, 0) < end for tp, end in ends.items()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._changed.wait()
        return True

    async def _publish(self, state: dict, *, wait: bool = True) -> None:
        state["version"] = state.get("version", 0) + 1
        value = msgspec.json.encode(state)
        self._states[state["id"]] = state
        future = await self._producer.send(self.topic, value, key=state["id"].encode(),
                                           partition=self._partition(state["id"]))
        if wait:
            await future

    async def _tombstone(self, response_id: str) -> None:
        self._states.pop(response_id, None)
        await (await self._producer.send(self.topic, None, key=response_id.encode(),
                                         partition=self._partition(response_id)))

    def _partition(self, response_id: str) -> int:
        """A response's partition, the same for all its records (compaction keeps the last one of a key per
        partition); CRC-32 in C, where the producer's default murmur2 runs in Python."""
        return zlib.crc32(response_id.encode()) % len(self._tps)

    # -- the API ----------------------------------------------------------------------------------------
    async def create(self, response_id: str, wire: GenerationRequest, priority: int, options: ResponseOptions,
                     owner: str, tenant: str | None) -> dict:
        now = self.clock()
        state = {"id": response_id, "owner": owner, "tenant": tenant, "runner": self.runner, "attempt": 0,
                 "request_id": f"{response_id}.0", "priority": priority, "wire": msgspec.to_builtins(wire),
                 "options": options.to_json(), "created_at": int(now), "expires_at": now +
                 self.settings.response_retention_s, "status": "queued", "response": None}
        size = len(msgspec.json.encode(state))
        if size > MAX_STATE_BYTES:
            raise ApiError(413, f"a background request must stay under {MAX_STATE_BYTES} bytes as stored; this one "
                           f"takes {size}", code="request_too_large")
        await self._publish(state)
        self._start(state)
        return self.public(state)

    def public(self, state: dict) -> dict:
        if state.get("response") is not None:
            return state["response"]
        return response_object(state["id"], state["created_at"], ResponseOptions.from_json(state["options"]),
                               status=state["status"])

    async def _find(self, response_id: str, owner: str) -> dict:
        state = self._states.get(response_id)
        if state is None:  # perhaps made a moment ago on another instance: read the topic to its end first
            await self._catch_up()
            state = self._states.get(response_id)
        if state is None or state["owner"] != owner or state["expires_at"] < self.clock():
            raise not_found("response", response_id)
        return state

    async def get(self, response_id: str, owner: str) -> dict:
        return self.public(await self._find(response_id, owner))

    async def cancel(self, response_id: str, owner: str) -> dict:
        """Cancels a background response wherever it runs: its request through the control topic (the worker
        answers `cancelled` with the text so far), then waits a little for the runner to record that."""
        state = await self._find(response_id, owner)
        if state["status"] in TERMINAL:
            return self.public(state)
        if state["runner"] == self.runner and response_id in self._tasks:
            self._cancel_local(response_id, "cancelled by its owner")
        else:
            await self.door.client.cancel(state["request_id"], "cancelled by its owner")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            state = self._states.get(response_id, state)
            if state["status"] in TERMINAL:
                break
            await asyncio.sleep(0.05)
        return self.public(state)

    async def delete(self, response_id: str, owner: str) -> dict:
        state = await self._find(response_id, owner)
        if state["status"] not in TERMINAL:
            if state["runner"] == self.runner and response_id in self._tasks:
                self._cancel_local(response_id, "response deleted")
            else:
                await self.door.client.cancel(state["request_id"], "response deleted")
        await self._tombstone(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _cancel_local(self, response_id: str, reason: str) -> None:
        self._cancelled.add(response_id)
        handle = self._handles.get(response_id)
        if handle is not None:
            self.door.client.cancel_later(handle.request_id, reason)

    # -- running ----------------------------------------------------------------------------------------
    def _start(self, state: dict) -> None:
        task = asyncio.create_task(self._run(state), name=f"response-{state['id']}")
        self._tasks[state["id"]] = task
        task.add_done_callback(lambda _: self._tasks.pop(state["id"], None))

    async def _run(self, state: dict) -> None:
        response_id = state["id"]
        async with self._slots:
            if response_id not in self._states:
                return  # deleted while it waited
            if state["status"] == "in_progress":  # this runner stopped while it ran: that attempt is abandoned
                self.door.client.cancel_later(state["request_id"], "resumed by a restarted gateway")
                state["attempt"] += 1
                state["request_id"] = f"{response_id}.{state['attempt']}"
            try:
                final, done, finish_reason = await self._send(state)
            except asyncio.CancelledError:
                raise
            except (RequestTimeout, ClientError, TimeoutError) as exc:
                await self._end(state, "failed", error={"code": "server_error", "message": str(exc)})
                return
            except Exception as exc:  # recorded as the response's failure, not lost
                log.exception("background response %s failed", response_id)
                await self._end(state, "failed", error={"code": "server_error", "message": repr(exc)})
                return
        status, error, incomplete = outcome(final, finish_reason)
        if response_id in self._cancelled and status == "failed":
            status, error = "cancelled", None
        text, calls = answer_of(done, final, ResponseOptions.from_json(state["options"]))
        await self._end(state, status, text=text, usage=final.usage, error=error, incomplete=incomplete,
                        tool_calls=calls)

    async def _send(self, state: dict):
        """Sends the request (again while it is shed) and waits for its answer: (final, text, finish_reason)."""
        response_id = state["id"]
        priority = state["priority"]
        wire = decode_request(msgspec.json.encode(state["wire"]))
        while True:
            while (refused := self.door.refusal(priority)) is not None and response_id not in self._cancelled:
                await asyncio.sleep(refused[1])
            request = msgspec.structs.replace(wire, id=state["request_id"])
            state["status"] = "in_progress"
            # Not waited for: the terminal state, written after it on the same partition, is; a restart that
            # finds `queued` resumes it the same way.
            await self._until_sent(lambda: self._publish(state, wait=False))
            # No caller waits on it: a background request may queue behind interactive work for as long as the
            # response is kept (its own timeout, when it has one, still ends it sooner).
            wait_s = None if request.timeout_ms is not None else self.settings.response_retention_s
            handle = await self._until_sent(lambda: self.door.submit(request, priority, wait_s=wait_s))
            self._handles[response_id] = handle
            try:
                if response_id in self._cancelled:
                    await handle.cancel("cancelled by its owner")
                final = await handle.result()
                completions = await handle.completions() if final.status in ("completed", "cancelled") else []
            finally:
                self._handles.pop(response_id, None)
            if final.status == "rejected" and final.reason in RETRIED_REASONS and response_id not in self._cancelled:
                state["attempt"] += 1
                state["request_id"] = f"{response_id}.{state['attempt']}"
                await asyncio.sleep(max(1.0, (final.retry_after_ms or 1000) / 1000))
                continue
            first = completions[0] if completions else None
            return final, first, first.finish_reason if first is not None else final.finish_reason

    async def _end(self, state: dict, status: str, *, text: str | None = None, usage=None, error: dict | None = None,
                   incomplete: dict | None = None, tool_calls: list[dict] | None = None) -> None:
        response_id = state["id"]
        self._cancelled.discard(response_id)
        if response_id not in self._states:
            return  # deleted while it ran
        now = int(self.clock())
        options = ResponseOptions.from_json(state["options"])
        state.update(status=status, ended_at=now, wire=None, response=response_object(
            response_id, state["created_at"], options, status=status, text=text, usage=usage, error=error,
            incomplete_details=incomplete, completed_at=now if status == "completed" else None,
            tool_calls=tool_calls))
        await self._until_sent(lambda: self._publish(state))
        self.num_finished += 1
        await self._notify(state)

    async def _until_sent(self, send):
        """`send()`, again while Kafka does not take it: a broker away for a while delays a background response
        rather than failing it (its caller is not waiting on an answer)."""
        backoff_s = 0.5
        while True:
            try:
                return await send()
            except (KafkaError, ClientError) as exc:
                if isinstance(exc, RequestTimeout):
                    raise
                log.warning("background responses: Kafka did not take a record (%r); again in %.1f s", exc,
                            backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)

    async def _notify(self, state: dict) -> None:
        await self.webhooks.emit(f"evt_{state['id'][5:]}", f"response.{state['status']}", state["id"],
                                 state.get("ended_at"))

    async def _sweep_every(self) -> None:
        interval_s = min(60.0, self.settings.response_retention_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            now = self.clock()
            for state in [s for s in self._states.values() if s["expires_at"] < now]:
                if state["status"] not in TERMINAL and state["runner"] == self.runner:
                    self._cancel_local(state["id"], "retention ended")
                try:
                    await self._tombstone(state["id"])
                except Exception as exc:  # noqa: BLE001 - tried again at the next sweep
                    log.warning("cannot delete expired response %s: %r", state["id"], exc)
                    break
