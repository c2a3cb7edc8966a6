"""Producing as real-world producers do: librdkafka (confluent-kafka), any compression codec, explicit
partitions, keys and timestamps; and reading back what the worker's group committed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from confluent_kafka import Producer

from schemas.priority import partition_for
from worker.kafka_settings import KafkaSettings

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


def produce_librdkafka(
    kafka: KafkaSettings, codec: str, items: Iterable[tuple[int, bytes | None, bytes | None, int | None]],
    topic: str | None = None, linger_ms: int = 20,
) -> int:
    """items: (partition, key, value, timestamp_ms or None); one librdkafka producer with `codec`, batching
    records as a busy producer would. Returns the number delivered; raises if any delivery failed."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "compression.type": codec,
                         "linger.ms": linger_ms, "enable.idempotence": True, "message.max.bytes": 2_000_000})
    errors: list = []
    delivered = [0]

    def on_delivery(err, _msg) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered[0] += 1

    for partition, key, value, timestamp_ms in items:
        kwargs = {"timestamp": timestamp_ms} if timestamp_ms is not None else {}
        while True:
            try:
                producer.produce(topic or kafka.request_topic, value=value, key=key, partition=partition,
                                 on_delivery=on_delivery, **kwargs)
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0, "records still undelivered after 60 s"
    assert not errors, errors[:3]
    return delivered[0]


def request_partition(kafka: KafkaSettings, priority: int, key: str) -> int:
    return partition_for(priority, key, kafka.num_request_partitions, kafka.num_priorities)


async def committed_and_end_offsets(kafka: KafkaSettings) -> tuple[dict[int, int], dict[int, int]]:
    """The worker group's committed offset and the log end offset of every request partition."""
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=kafka.group_id, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(kafka.request_topic, p) for p in range(kafka.num_request_partitions)]
        ends = await consumer.end_offsets(partitions)
        committed = {tp.partition: (await consumer.committed(tp)) or 0 for tp in partitions}
        return committed, {tp.partition: offset for tp, offset in ends.items()}
    finally:
        await consumer.stop()


async def wait_until_committed_to_end(kafka: KafkaSettings, timeout_s: float) -> dict[int, tuple[int, int]]:
    """Polls until the group has committed every request partition up to its log end; returns the last
    (committed, end) per partition either way."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        committed, ends = await committed_and_end_offsets(kafka)
        state = {p: (committed[p], ends[p]) for p in ends}
        if all(c == e for c, e in state.values()) or loop.time() > deadline:
            return state
        await asyncio.sleep(0.5)
