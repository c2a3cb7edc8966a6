"""The batching publisher against a real broker: order per key, one ack callback per group, and recovery
from a batch the broker refuses (an idempotent producer is left with a sequence gap and must be replaced)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer

from worker.transport.kafka.publisher import Publisher

pytestmark = pytest.mark.kafka


async def read_all(kafka, topic: str, count: int, timeout_s: float = 20) -> list:
    consumer = AIOKafkaConsumer(topic, **kafka.client_kwargs(), auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    records = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(records) < count:
                for msgs in (await consumer.getmany(timeout_ms=200)).values():
                    records += msgs
    finally:
        await consumer.stop()
    return records


async def test_order_acks_and_recovery_after_a_refused_batch(kafka_topics):
    kafka = kafka_topics
    publisher = Publisher(kafka.client_kwargs(), max_request_size=8 * 1024 * 1024)
    publisher.retry_backoff_s = 0.1
    await publisher.start()
    acked: list[int] = []
    try:
        for i in range(100):
            publisher.publish_nowait(kafka.result_topic, f"k{i % 7}".encode(), f"{i}".encode(),
                                     lambda i=i: acked.append(i))
        # Bigger than the topic's max.message.bytes (about 1 MiB, as the broker reports it): never sent, dropped;
        # its callback still runs (settled, not delivered), so the request offset it answers cannot wait forever.
        publisher.publish_nowait(kafka.result_topic, b"k0", b"x" * (2 * 1024 * 1024), lambda: acked.append(-1))
        await publisher.wait_acked(20)
        group_done = []
        publisher.publish_group_nowait([(kafka.result_topic, b"k1", f"{100 + j}".encode(), None) for j in range(3)],
                                       lambda: group_done.append(True))
        for i in range(103, 200):
            publisher.publish_nowait(kafka.result_topic, f"k{i % 7}".encode(), f"{i}".encode(),
                                     lambda i=i: acked.append(i))
        assert await publisher.wait_acked(30)
    finally:
        await publisher.stop()
    assert group_done == [True]  # one callback for the group, after its last record
    assert sorted(acked) == [-1] + [i for i in range(200) if not 100 <= i < 103]
    assert publisher.num_producer_resets == 0 and publisher.num_dropped_records == 1
    records = await read_all(kafka, kafka.result_topic, 200)
    by_key: dict[bytes, list[int]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(int(record.value))
    for values in by_key.values():
        assert values == sorted(values)  # per key, publish order
    assert sorted(v for vs in by_key.values() for v in vs) == list(range(200))


async def test_records_gather_for_the_gather_time_before_a_send(kafka_topics):
    kafka = kafka_topics
    sent_batches = {}
    for gather_s in (0.0, 0.5):
        publisher = Publisher(kafka.client_kwargs(), gather_s=lambda g=gather_s: g)
        await publisher.start()
        try:
            await publisher.wait_acked(10)
            # Know the topic first: records for a topic being looked up wait for the lookup and would go
            # in one batch whatever the gather time.
            known = asyncio.Event()
            publisher.destinations.resolve(kafka.result_topic, on_done=known.set)
            await asyncio.wait_for(known.wait(), 10)
            for i in range(10):  # a record every 20 ms: 180 ms from the first to the last
                publisher.publish_nowait(kafka.result_topic, b"k", f"{gather_s}:{i}".encode())
                await asyncio.sleep(0.02)
            assert await publisher.wait_acked(20)
            sent_batches[gather_s] = publisher.num_batches_sent
        finally:
            await publisher.stop()
    assert sent_batches[0.5] == 1  # all ten gathered into one batch
    assert sent_batches[0.0] > 1  # sent as they came
    values = [r.value.decode() for r in await read_all(kafka, kafka.result_topic, 20)]
    assert values == [f"{g}:{i}" for g in (0.0, 0.5) for i in range(10)]  # nothing lost, order kept
