"""Shared pieces of the client tests: an in-process worker on the model-free instant engine, the raw records
a worker would write (to drive the client without one), and reading the request topic back. Real Kafka."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.decode import encode
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk, Usage
from worker.kafka_settings import KafkaSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.instant import expected_text


def instant_text(request: GenerationRequest) -> str:
    """What the instant engine answers to a request (a pure function of its prompt and max_new_tokens)."""
    messages = [{"role": m.role, "content": m.content} for m in request.messages] if request.messages else None
    engine_request = EngineRequest(request_id=request.id, prompt=request.prompt, messages=messages,
                                   prompt_token_ids=request.prompt_token_ids,
                                   sampling=SamplingParams(max_new_tokens=request.max_new_tokens))
    return expected_text(engine_request)


def new_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def chunk(request_id: str, attempt: int, seq: int, text: str) -> StreamChunk:
    return StreamChunk(id=request_id, attempt=attempt, seq=seq, token_ids=[seq], text=text)


def completed(request_id: str, attempt: int, text: str, num_chunks: int) -> FinalRecord:
    return FinalRecord(id=request_id, attempt=attempt, status="completed", reason="length", finish_reason="length",
                       text=text, num_chunks=num_chunks, usage=Usage(completion_tokens=num_chunks))


class RawProducer:
    """Writes records straight to a topic, as a worker would (key = request id or worker id)."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.producer = AIOKafkaProducer(**kafka.client_kwargs(), enable_idempotence=True)

    async def __aenter__(self) -> "RawProducer":
        await self.producer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.producer.stop()

    async def results(self, *records: StreamChunk | FinalRecord) -> None:
        for record in records:
            await self.producer.send_and_wait(self.kafka.result_topic, encode(record), key=record.id.encode())

    async def status(self, status) -> None:
        await self.producer.send_and_wait(self.kafka.status_topic, encode(status), key=status.worker_id.encode())


async def read_topic(kafka: KafkaSettings, topic: str, num_records: int, timeout_s: float = 15.0) -> list:
    """The first num_records records of a topic, from the beginning (all partitions)."""
    consumer = AIOKafkaConsumer(topic, **kafka.client_kwargs(), group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    records = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(records) < num_records and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(messages)
    finally:
        await consumer.stop()
    return records


async def eventually(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.05)
