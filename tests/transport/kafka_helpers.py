"""Shared pieces of the transport's Kafka integration tests: produce requests by priority, collect every
result record, run a worker in-process or as a subprocess. Real Kafka only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.decode import decode_dead_letter, decode_result, decode_status, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]


def worker_settings(**overrides) -> WorkerSettings:
    values = dict(metrics_port=0, worker_id=f"test-{uuid.uuid4().hex[:6]}", status_interval_s=0.2,
                  commit_interval_s=0.2, session_timeout_s=6.0, drain_timeout_s=20.0)
    values.update(overrides)
    return WorkerSettings(**values)


async def produce(kafka: KafkaSettings, items: list[tuple]) -> list:
    """items: (priority, value bytes, key[, routing key]); each to the partition its priority and routing key
    (default: the key) give. Returns each record's RecordMetadata (partition, offset), in order."""
    producer = AIOKafkaProducer(**kafka.client_kwargs(), enable_idempotence=True, max_request_size=4 * 1024 * 1024)
    await producer.start()
    try:
        futures = []
        for priority, value, key, *route in items:
            partition = partition_for(priority, route[0] if route else key, kafka.num_request_partitions,
                                      kafka.num_priorities)
            futures.append(await producer.send(kafka.request_topic, value=value, key=key.encode(), partition=partition))
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


async def produce_requests(kafka: KafkaSettings, requests: list[tuple[int, GenerationRequest]]) -> dict:
    """Returns {request id: (partition, offset)} of the records written."""
    written = await produce(kafka, [(p, encode(r), r.id, r.routing_key) for p, r in requests])
    return {r.id: (meta.partition, meta.offset) for (_, r), meta in zip(requests, written)}


@dataclass
class Results:
    chunks: dict[tuple[str, int], list[StreamChunk]] = field(default_factory=lambda: defaultdict(list))
    finals: dict[str, list[FinalRecord]] = field(default_factory=lambda: defaultdict(list))
    dead_letters: list = field(default_factory=list)
    statuses: list = field(default_factory=list)
    undecodable: int = 0

    def latest_final(self, request_id: str) -> FinalRecord:
        return max(self.finals[request_id], key=lambda f: f.attempt)

    def stream_of(self, final: FinalRecord, index: int = 0) -> list[StreamChunk]:
        """The chunks of the stream `final` ends: its attempt's, and when that attempt resumed an earlier one's
        stream (resumed_at), the earlier attempts' chunks below that seq (the latest attempt's where several
        sent one), as a reader that follows resumed_at keeps them."""
        mine = [c for c in self.chunks.get((final.id, final.attempt), []) if c.index == index]
        if final.resumed_at is None:
            return mine
        earlier: dict[int, StreamChunk] = {}
        for (request_id, attempt), chunks in sorted(self.chunks.items(), key=lambda kv: kv[0][1]):
            if request_id == final.id and attempt < final.attempt:
                earlier.update({c.seq: c for c in chunks if c.index == index and c.seq < final.resumed_at})
        return [earlier[seq] for seq in sorted(earlier)] + mine

    def delivered(self, final: FinalRecord, streamed: bool) -> tuple[list[int], str]:
        """A request's tokens and text as its reader gets them: from its stream's chunks (checked whole and in
        order), or from its final when it did not stream."""
        if not streamed:
            return final.token_ids, final.text
        chunks = self.stream_of(final)
        assert [c.seq for c in chunks] == list(range(len(chunks))), final.id
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)

    def stream_text(self, request_id: str, attempt: int) -> str:
        return "".join(c.text for c in self.chunks[(request_id, attempt)])

    def summary(self) -> str:
        """What was collected, and each worker's latest status: what a timed-out wait reports."""
        statuses = {}
        for s in self.statuses:
            statuses[s.worker_id] = s
        finals = [f for fs in self.finals.values() for f in fs]
        lines = [f"{len(self.finals)} requests with finals ({len(finals)} finals, "
                 f"{sum(f.status == 'completed' for f in finals)} completed), {len(self.chunks)} streams, "
                 f"{len(self.dead_letters)} dead letters, {len(self.statuses)} statuses"]
        for wid, s in sorted(statuses.items()):
            lines.append(f"  {wid} at {s.ts_ms}: partitions {s.assigned_partitions} paused {s.paused_partitions} "
                         f"running {s.num_running} waiting {s.num_waiting} kv {s.kv_usage:.2f} "
                         f"last step {s.last_step_ms:.0f} ms, preemptions {s.num_preemptions}")
        return "\n".join(lines)


class WaitTimeout(TimeoutError, AssertionError):
    """A collector's wait ran out: a TimeoutError for callers that expect one, and a failed check with what was
    collected for pytest."""


class Collector:
    """Reads the result, dead-letter and status topics from the beginning, in the background."""

    def __init__(self, kafka: KafkaSettings, extra_topics: tuple[str, ...] = (),
                 isolation_level: str = "read_uncommitted") -> None:
        self.kafka = kafka
        self.isolation_level = isolation_level
        self.results = Results()
        self.topics = (kafka.result_topic, kafka.dead_letter_topic, kafka.status_topic, *extra_topics)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Collector":
        self._consumer = AIOKafkaConsumer(*self.topics, **self.kafka.client_kwargs(), auto_offset_reset="earliest",
                                          enable_auto_commit=False, group_id=None, metadata_max_age_ms=1000,
                                          isolation_level=self.isolation_level)
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._consumer.stop()

    async def _run(self) -> None:
        r = self.results
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for tp, msgs in batches.items():
                for msg in msgs:
                    try:
                        if tp.topic == self.kafka.dead_letter_topic:
                            r.dead_letters.append(decode_dead_letter(msg.value))
                        elif tp.topic == self.kafka.status_topic:
                            r.statuses.append(decode_status(msg.value))
                        else:
                            record = decode_result(msg.value)
                            if isinstance(record, StreamChunk):
                                r.chunks[(record.id, record.attempt)].append(record)
                            else:
                                r.finals[record.id].append(record)
                    except msgspec.DecodeError:
                        r.undecodable += 1

    async def wait_until(self, predicate, timeout_s: float, what: str = "condition") -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate(self.results):
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise WaitTimeout(f"{what} not met in {timeout_s} s; {self.results.summary()}") from None


@contextlib.asynccontextmanager
async def running_worker(kafka: KafkaSettings, settings: WorkerSettings, engine, **kwargs):
    from worker.transport.worker import Worker

    worker = Worker(kafka, settings, engine, **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(30):
            await worker.started.wait()
        yield worker
    finally:
        worker.stop()
        assert await asyncio.wait_for(task, 60) == 0
        # Whatever the test did to it, no request was answered twice, or after it was given up.
        assert worker.answers.book.violations == []


def subprocess_env(kafka: KafkaSettings, **worker_env) -> dict[str, str]:
    env = dict(os.environ)
    # Tests start several workers beside the broker and pytest on 2 cores. With torch's default of one OpenMP
    # thread per core, two workers' threads spin against each other: in one fresh-clone run both calibrated
    # the tiny model at ~480 ms a step (15 ms when alone), and the survivor of the SIGKILL test shed 30
    # requests it could serve on that estimate. One thread each, as a deployment of several workers per host
    # would be configured (docs/scaling.md, "Several workers on one host").
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({
        "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "KAFKA_REQUEST_TOPIC": kafka.request_topic,
        "KAFKA_RESULT_TOPIC": kafka.result_topic, "KAFKA_DEAD_LETTER_TOPIC": kafka.dead_letter_topic,
        "KAFKA_STATUS_TOPIC": kafka.status_topic, "KAFKA_CONTROL_TOPIC": kafka.control_topic,
        "KAFKA_USAGE_TOPIC": kafka.usage_topic, "KAFKA_PROGRESS_TOPIC": kafka.progress_topic,
        "KAFKA_GROUP_ID": kafka.group_id,
        "WORKER_METRICS_PORT": "0", "WORKER_STATUS_INTERVAL_S": "0.2", "WORKER_COMMIT_INTERVAL_S": "0.2",
        "WORKER_SESSION_TIMEOUT_S": "6",
    })
    env.update({f"WORKER_{k.upper()}": str(v) for k, v in worker_env.items()})
    return env


async def start_worker_process(kafka: KafkaSettings, args: list[str], log_path: Path, **worker_env):
    log = open(log_path, "ab")
    return await asyncio.create_subprocess_exec(
        str(REPO / ".venv" / "bin" / "llm-worker"), "serve", *args, env=subprocess_env(kafka, **worker_env),
        stdout=log, stderr=log, cwd=str(REPO),
    )


def polling_clients(bootstrap_servers: str) -> list:
    """aiokafka clients of this address whose metadata task still runs (a client never closed)."""
    import gc

    from aiokafka.client import AIOKafkaClient

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, AIOKafkaClient) and o._sync_task is not None
            and not o._sync_task.done() and bootstrap_servers in str(o._bootstrap_servers)]
