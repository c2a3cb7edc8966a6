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


async def test_a_topic_limit_lowered_under_the_publisher_refuses_only_what_no_longer_fits(kafka_topics):
    """The broker refuses a batch the publisher built for the topic's old limit: the producer is replaced (its
    sequence has a gap) and every record that still fits arrives, in order; only the one that is now too large
    on its own is answered as such. Before, every record of the refused batch was dropped with it."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    kafka = kafka_topics
    publisher = Publisher(kafka.client_kwargs(), gather_s=lambda: 0.3)
    publisher.retry_backoff_s = 0.1
    await publisher.start()
    acked: list[int] = []
    try:
        for i in range(5):  # the limit read while the topic was at its default
            publisher.publish_nowait(kafka.result_topic, b"k", f"{i:04d}".encode(), lambda i=i: acked.append(i))
        assert await publisher.wait_acked(20)
        admin = AIOKafkaAdminClient(**kafka.client_kwargs())
        await admin.start()
        try:
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, kafka.result_topic,
                                                      {"max.message.bytes": "4000"})])
        finally:
            await admin.close()
        # 40 records of ~250 bytes gather into one batch of ~10 kB under the old limit: over the new one.
        for i in range(5, 45):
            publisher.publish_nowait(kafka.result_topic, b"k", f"{i:04d}".encode() + b"." * 250,
                                     lambda i=i: acked.append(i))
        publisher.publish_nowait(kafka.result_topic, b"k", b"9999" + b"x" * 6000, lambda: acked.append(-1))
        for i in range(45, 50):
            publisher.publish_nowait(kafka.result_topic, b"k", f"{i:04d}".encode(), lambda i=i: acked.append(i))
        assert await publisher.wait_acked(30)
    finally:
        await publisher.stop()
    assert sorted(acked) == [-1] + list(range(50))
    assert publisher.num_dropped_records == 1  # the 6 kB record alone
    assert publisher.num_producer_resets >= 1  # the fault hit: the broker refused a batch the producer sent
    values = [int(r.value[:4]) for r in await read_all(kafka, kafka.result_topic, 50)]
    # At least once: a record the old producer may have landed before the refusal can come again, in order.
    assert sorted(set(values)) == list(range(50)) and 9999 not in values
    assert [v for i, v in enumerate(values) if i == 0 or v > values[i - 1]] == list(range(50))
