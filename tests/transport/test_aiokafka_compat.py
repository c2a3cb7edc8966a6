"""aiokafka's private state that worker/transport/kafka/aiokafka_compat.py (and worker/kafka_stop.py) reads:
these fail when a new aiokafka release moves it, before a worker would fail in production."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from worker.transport.kafka.aiokafka_compat import (back_off_failed_metadata_updates, cache_scram_salted_passwords,
                                                    committed_with_metadata, fail_unsent_batches, group_generation,
                                                    producer_is_dead)


async def test_an_unstarted_consumer_has_no_group_coordinator_yet():
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", group_id="g")
    with pytest.raises(RuntimeError, match="not started"):
        group_generation(consumer)


async def test_a_producer_holds_an_accumulator_whose_batches_can_be_failed():
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    fail_unsent_batches(producer, KafkaError("test"))  # nothing pending: a no-op, but every name must exist
    await producer.stop()


async def test_clients_hold_what_a_failed_stop_is_finished_with():
    """worker/kafka_stop.py closes by hand what a failed or overlong stop left open."""
    from aiokafka.client import AIOKafkaClient

    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    assert callable(producer._message_accumulator.fail_all) and callable(producer._sender.close)
    assert isinstance(producer.client, AIOKafkaClient) and isinstance(consumer._client, AIOKafkaClient)


async def test_a_producer_whose_sender_died_is_dead():
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", transactional_id="t")
    assert not producer_is_dead(producer)  # not started: no sender task yet

    async def dies():
        raise KafkaError("Unexpected error during batch delivery")

    producer._sender._sender_task = asyncio.ensure_future(dies())
    producer._sender._sender_task.add_done_callback(producer._sender._fail_all)
    await asyncio.gather(producer._sender._sender_task, return_exceptions=True)
    await asyncio.sleep(0)
    assert producer_is_dead(producer) and producer._txn_manager.is_fatal_error()
    producer._sender._sender_task = None
    await producer.stop()


async def test_metadata_updates_that_reach_no_broker_back_off_doubling():
    """A client whose broker is gone: each failed update waits 0.1 s, then 0.2, 0.4 (aiokafka alone retries
    every 100 ms as often as it is asked, a socket and an error line each time)."""
    from aiokafka.client import AIOKafkaClient

    back_off_failed_metadata_updates()
    back_off_failed_metadata_updates()  # a second call leaves one wrapper
    client = AIOKafkaClient(bootstrap_servers="127.0.0.1:1")
    waits = []
    for _ in range(3):
        start = asyncio.get_running_loop().time()
        assert await client._metadata_update(client.cluster, set()) is False
        waits.append(asyncio.get_running_loop().time() - start)
    await client.close()
    assert waits[0] >= 0.1 and waits[1] >= 0.2 and 0.4 <= waits[2] < 0.8, waits


def test_scram_logins_derive_the_salted_password_once_and_still_agree_with_the_rfc():
    from aiokafka.conn import ScramAuthenticator

    cache_scram_salted_passwords()
    cache_scram_salted_passwords()  # twice: still one wrapper
    assert ScramAuthenticator.create_salted_password.cached

    def login(password: str) -> ScramAuthenticator:
        auth = ScramAuthenticator(loop=None, sasl_plain_password=password, sasl_plain_username="user",
                                  sasl_mechanism="SCRAM-SHA-256")
        auth.create_salted_password(b"salt-of-the-user", 4096)
        return auth

    first, second, other = login("pencil"), login("pencil"), login("another")
    assert first._salted_password == second._salted_password != other._salted_password
    assert first._salted_password == hashlib.pbkdf2_hmac("sha256", b"pencil", b"salt-of-the-user", 4096)


@pytest.mark.kafka
async def test_the_group_generation_is_read_after_a_join_and_grows_with_each_rebalance(kafka_topics):
    kafka = kafka_topics
    def consumer() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(kafka.request_topic, **kafka.client_kwargs(), group_id=f"{kafka.group_id}-compat",
                                session_timeout_ms=6000, heartbeat_interval_ms=1000)

    first = consumer()
    await first.start()
    try:
        async with asyncio.timeout(30):
            while not first.assignment():
                await first.getmany(timeout_ms=100)
        generation = group_generation(first)
        assert generation >= 1
        second = consumer()
        await second.start()
        try:
            async with asyncio.timeout(30):
                while group_generation(first) == generation or not second.assignment():
                    await asyncio.gather(first.getmany(timeout_ms=100), second.getmany(timeout_ms=100))
            assert group_generation(first) == group_generation(second) > generation
        finally:
            await second.stop()
    finally:
        await first.stop()


@pytest.mark.kafka
async def test_committed_offsets_come_back_with_their_metadata(kafka_topics):
    """The progress record of exactly-once commits (progress.py) travels as offset metadata: written through a
    plain commit here, read back through the coordinator as the worker reads it at an assignment."""
    kafka = kafka_topics
    tp = TopicPartition(kafka.request_topic, 1)
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=f"{kafka.group_id}-meta", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        assert await committed_with_metadata(consumer, [tp]) == {}  # nothing committed yet
        await consumer.commit({tp: (7, "llmw1@7:1.2")})
        assert await committed_with_metadata(consumer, [tp]) == {tp: (7, "llmw1@7:1.2")}
    finally:
        await consumer.stop()
