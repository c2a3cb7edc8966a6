"""A fleet of `llm-worker serve` subprocesses on fresh topics of a broker, with a reader of their finals and
statuses: what a benchmark of several workers sends to and reads from (bench_tenants, bench_lora_affinity)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.decode import decode_result, decode_status, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings

REPO = Path(__file__).resolve().parents[2]


class Run:
    """Fresh topics, worker subprocesses, a reader of results and statuses."""

    def __init__(self, bootstrap: str, tmp: Path, name: str, env: dict[str, str], args: list[str], num_workers: int,
                 partitions_per_priority: int = 2):
        suffix = uuid.uuid4().hex[:8]
        self.kafka = KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"ten.requests.{suffix}",
                                   result_topic=f"ten.results.{suffix}", dead_letter_topic=f"ten.dlq.{suffix}",
                                   status_topic=f"ten.status.{suffix}", control_topic=f"ten.control.{suffix}",
                                   group_id=f"ten-{suffix}", partitions_per_priority=partitions_per_priority)
        self.name, self.tmp, self.env, self.args, self.num_workers = name, tmp, env, args, num_workers
        self.finals: dict[str, FinalRecord] = {}
        self.assigned: dict[str, tuple[int, ...]] = {}
        self.statuses: dict[str, object] = {}
        """Each worker's latest status record."""
        self.chunks: list[tuple[str, float, int]] = []
        """(request id, record timestamp in s, tokens) of every stream chunk: service as it was delivered."""
        self.procs: list[subprocess.Popen] = []

    async def __aenter__(self) -> "Run":
        await ensure_topics(self.kafka)
        k = self.kafka
        env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=k.bootstrap_servers, KAFKA_REQUEST_TOPIC=k.request_topic,
                   KAFKA_RESULT_TOPIC=k.result_topic, KAFKA_DEAD_LETTER_TOPIC=k.dead_letter_topic,
                   KAFKA_STATUS_TOPIC=k.status_topic, KAFKA_CONTROL_TOPIC=k.control_topic, KAFKA_GROUP_ID=k.group_id,
                   KAFKA_PARTITIONS_PER_PRIORITY=str(k.partitions_per_priority),
                   WORKER_METRICS_PORT="0", WORKER_STATUS_INTERVAL_S="0.5", OMP_NUM_THREADS="1", ENGINE_DEVICE="cpu")
        env.update(self.env)
        for i in range(self.num_workers):
            log = open(self.tmp / f"{self.name}-worker-{i}.log", "wb")
            self.procs.append(subprocess.Popen([str(REPO / ".venv/bin/llm-worker"), "serve", *self.args], cwd=REPO,
                                               stdout=log, stderr=log,
                                               env=dict(env, WORKER_WORKER_ID=f"{self.name}-{i}")))
        self.consumer = AIOKafkaConsumer(k.result_topic, k.status_topic, **k.client_kwargs(), group_id=None,
                                         enable_auto_commit=False, auto_offset_reset="earliest")
        await self.consumer.start()
        self.reader = asyncio.create_task(self._read())
        self.producer = AIOKafkaProducer(**k.client_kwargs(), linger_ms=5)
        await self.producer.start()
        deadline = time.monotonic() + 300
        while sum(len(p) for p in self.assigned.values()) < k.num_request_partitions or len(
                self.assigned) < self.num_workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"workers of {self.name} did not start; logs in {self.tmp}")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the assignment settles (a second join moves partitions once)
        return self

    async def __aexit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.reader.cancel()
        await self.producer.stop()
        await self.consumer.stop()

    async def _read(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100, max_records=5000)
            for tp, msgs in batches.items():
                for msg in msgs:
                    if tp.topic == self.kafka.status_topic:
                        status = decode_status(msg.value)
                        self.assigned[status.worker_id] = tuple(status.assigned_partitions)
                        self.statuses[status.worker_id] = status
                        continue
                    record = decode_result(msg.value)
                    if isinstance(record, FinalRecord) and record.index is None:
                        self.finals[record.id] = record
                    elif isinstance(record, StreamChunk) and record.token_ids:
                        self.chunks.append((record.id, msg.timestamp / 1000.0, len(record.token_ids)))

    async def send(self, request: GenerationRequest, priority: int = 1, key: str | None = None) -> None:
        """To the partition of its priority its routing key picks, or `key` where given."""
        k = self.kafka
        partition = partition_for(priority, key or request.routing_key, k.num_request_partitions, k.num_priorities)
        await self.producer.send(k.request_topic, encode(request), key=request.id.encode(), partition=partition)

    async def wait_for(self, ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(i not in self.finals for i in ids):
            if time.monotonic() > deadline:
                missing = sum(i not in self.finals for i in ids)
                raise RuntimeError(f"{self.name}: {missing} of {len(ids)} finals missing; logs in {self.tmp}")
            await asyncio.sleep(0.1)
