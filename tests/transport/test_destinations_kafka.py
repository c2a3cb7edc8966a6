"""One bad destination never stalls a worker, against a real broker: a reply topic that is missing from the
start, one deleted while the worker writes to it, one the worker may not write (ACLs), and a final record
larger than its topic takes. In each, ordinary requests sent meanwhile complete with their usual latency, the
bad request gets exactly one final that names the cause, and the group's commits reach the log end."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from schemas.decode import encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest, SamplingSpec
from worker.engine.instant import InstantEngine
from tests.transport.kafka_helpers import Collector, polling_clients, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka


async def create_topic(kafka, name: str, **configs: str) -> None:
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs or None)])
    finally:
        await admin.close()


async def delete_topic(kafka, name: str) -> None:
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        await admin.delete_topics([name])
    finally:
        await admin.close()


async def commits_reach_the_log_end(kafka, timeout_s: float = 15.0) -> None:
    """Every request partition's committed offset equals its end offset (nothing held back)."""
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=kafka.group_id, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(kafka.request_topic, p) for p in range(kafka.num_request_partitions)]
        deadline = time.monotonic() + timeout_s
        while True:
            ends = await consumer.end_offsets(partitions)
            committed = {tp: (await consumer.committed(tp)) or 0 for tp in partitions}
            behind = {tp.partition: (committed[tp], ends[tp]) for tp in partitions if committed[tp] != ends[tp]}
            if not behind:
                return
            assert time.monotonic() < deadline, f"commits behind the log end (committed, end): {behind}"
            await asyncio.sleep(0.3)
    finally:
        await consumer.stop()


async def send_to(kafka, request_id: str, reply_topic: str) -> None:
    """One short request at priority 1 whose answers go to `reply_topic`."""
    await produce_requests(kafka, [(1, GenerationRequest(id=request_id, prompt="p", max_new_tokens=4,
                                                         reply_topic=reply_topic))])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ordinary_stream(kafka, collector: Collector, tag: str, count: int, gap_s: float) -> list[float]:
    """`count` ordinary requests at priority 1, one every `gap_s`; their time to final (s), each from its
    produce to its final's arrival at the collector."""
    sent: dict[str, float] = {}
    arrived: dict[str, float] = {}

    async def watch() -> None:
        while len(arrived) < count:
            for request_id in list(sent):
                if request_id not in arrived and collector.results.finals.get(request_id):
                    arrived[request_id] = time.monotonic()
            await asyncio.sleep(0.005)

    producer = AIOKafkaProducer(**kafka.client_kwargs(), enable_idempotence=True)
    await producer.start()
    watcher = asyncio.create_task(watch())
    try:
        for i in range(count):
            request = GenerationRequest(id=f"{tag}-{i}", prompt=f"ordinary {tag} {i}", max_new_tokens=4)
            partition = partition_for(1, request.id, kafka.num_request_partitions, kafka.num_priorities)
            sent[request.id] = time.monotonic()
            await producer.send(kafka.request_topic, encode(request), key=request.id.encode(), partition=partition)
            await asyncio.sleep(gap_s)
        await asyncio.wait_for(watcher, 60)
    finally:
        watcher.cancel()
        await producer.stop()
    for request_id in sent:
        finals = collector.results.finals[request_id]
        assert len(finals) == 1 and finals[0].status == "completed", finals
    return [arrived[r] - sent[r] for r in sent]


def report(name: str, latencies: list[float]) -> str:
    return f"{name}: p50 {percentile(latencies, 0.5) * 1000:.0f} ms, p99 {percentile(latencies, 0.99) * 1000:.0f} ms"


async def test_missing_and_deleted_reply_topics_answer_on_the_result_topic_and_stall_nothing(kafka_topics, caplog):
    kafka = kafka_topics
    missing, doomed = f"reply.missing.{uuid.uuid4().hex[:6]}", f"reply.doomed.{uuid.uuid4().hex[:6]}"
    await create_topic(kafka, doomed)
    kafka = kafka.model_copy(update={"allowed_reply_topics": [missing, doomed]})
    wait_s = 2.0
    settings = worker_settings(destination_wait_s=wait_s)
    # The doomed topic is read by a consumer of its own: a subscribed topic that disappears makes a group-less
    # consumer re-read its other topics from the start.
    async with Collector(kafka) as collector, Collector(kafka.model_copy(update={"result_topic": doomed})) as on_doomed:
        # 2 ms steps: the long request below streams for 6 s, across the deletion.
        async with running_worker(kafka, settings, InstantEngine(max_num_seqs=16, step_time_s=0.002)):
            await ordinary_stream(kafka, collector, "warm-up", 10, 0.05)
            baseline = await ordinary_stream(kafka, collector, "base", 30, 0.05)

            # Missing from the start: known at start-up, answered at once on the result topic.
            sent = time.monotonic()
            await send_to(kafka, "to-missing", missing)
            with_missing = await ordinary_stream(kafka, collector, "missing", 30, 0.05)
            await collector.wait_until(lambda r: r.finals.get("to-missing"), 10, "the missing topic's final")
            missing_final_s = time.monotonic() - sent

            # A reply topic that works, then is deleted while the worker writes to it: a long request streams
            # there when it goes (its chunks in flight), and its final must still come, on the result topic.
            await send_to(kafka, "to-doomed-ok", doomed)
            await on_doomed.wait_until(lambda r: r.finals.get("to-doomed-ok"), 20, "the doomed topic's first final")
            await produce_requests(kafka, [(1, GenerationRequest(id="streaming-when-deleted", prompt="long",
                                                                 max_new_tokens=3000, reply_topic=doomed))])
            await on_doomed.wait_until(lambda r: any(i == "streaming-when-deleted" for i, _ in r.chunks), 20,
                                       "the long request streaming to the doomed topic")
            await delete_topic(kafka, doomed)
            await asyncio.sleep(0.5)
            sent = time.monotonic()
            await send_to(kafka, "to-doomed", doomed)
            with_deleted = await ordinary_stream(kafka, collector, "deleted", 60, 0.1)
            await collector.wait_until(lambda r: r.finals.get("to-doomed"), 30, "the deleted topic's final")
            await collector.wait_until(lambda r: r.finals.get("streaming-when-deleted"), 30,
                                       "the final of the request streaming when its topic went")
            deleted_final_s = time.monotonic() - sent
            await commits_reach_the_log_end(kafka)
    results = collector.results
    for request_id, topic in (("to-missing", missing), ("to-doomed", doomed), ("streaming-when-deleted", doomed)):
        finals = results.finals[request_id]
        assert len(finals) == 1, [(f.message, f.timings, f.worker_id) for f in finals]
        final = finals[0]
        assert (final.status, final.reason) == ("error", "reply_topic_unavailable"), final
        assert topic in final.message
    # One clear line for the missing topic, not a flood of aiokafka errors (none of this test's own consumers
    # reads it, so every line naming it is the worker's).
    about_missing = [r for r in caplog.records if missing in r.getMessage()]
    assert [r.levelname for r in about_missing if r.name.startswith("worker.")] == ["WARNING"], about_missing
    assert len([r for r in about_missing if r.levelname == "ERROR"]) <= 2, about_missing
    assert [f.status for f in on_doomed.results.finals["to-doomed-ok"]] == ["completed"]
    assert "to-doomed-ok" not in results.finals
    figures = "; ".join([report("baseline", baseline), report("missing topic", with_missing),
                         report("deleted topic", with_deleted),
                         f"final of the missing {missing_final_s:.2f} s, of the deleted {deleted_final_s:.2f} s"])
    print(figures)
    # The missing topic costs the ordinary requests nothing; the deleted one at most the destination bound once
    # (the producer that held its batch is replaced), never a stall. With 30 samples p99 is the slowest one, which
    # a busy 2-core host can delay by most of a second; a stall on the destination costs `wait_s` (2 s), so a
    # 1 s slack still tells the two apart.
    assert percentile(with_missing, 0.5) <= 2 * percentile(baseline, 0.5) + 0.1, figures
    assert percentile(with_missing, 0.99) <= 2 * percentile(baseline, 0.99) + 1.0, figures
    # A topic deleted under a stream in flight: the producer holding its batch is replaced once, after the
    # destination bound, and every other record waits for that once (docs/delivery.md, "Destinations"): the
    # ordinary requests sent in that window are late by at most the bound and the replacement, and those sent
    # after it are back to the baseline (the stall does not last or repeat).
    assert percentile(with_deleted, 0.99) <= percentile(baseline, 0.99) + wait_s + 2.0, figures
    after_stall = with_deleted[int((wait_s + 2.5) / 0.1):]
    assert after_stall and percentile(after_stall, 0.5) <= 2 * percentile(baseline, 0.5) + 0.1, figures
    assert percentile(after_stall, 0.99) <= 2 * percentile(baseline, 0.99) + 1.0, figures
    assert missing_final_s < 3.0 and deleted_final_s < 4 * wait_s + 5.0, figures


@pytest.mark.slow
async def test_a_final_too_large_for_its_topic_goes_without_its_logprobs_or_as_an_error(kafka_topics,
                                                                                       tiny_model_path):
    """The broker's own limit, not an assumed 1 MB: 1,200 tokens with top_logprobs 20 (a final of about 1.2 MB)
    on the result topic, and shorter ones on a reply topic whose max.message.bytes is 64 KiB and one whose limit
    is below the text itself."""
    from tests.transport.test_stream_kafka import tiny_engine

    kafka = kafka_topics
    small, tiny = f"reply.small.{uuid.uuid4().hex[:6]}", f"reply.tiny.{uuid.uuid4().hex[:6]}"
    await create_topic(kafka, small, **{"max.message.bytes": str(64 * 1024)})
    await create_topic(kafka, tiny, **{"max.message.bytes": "2048"})
    kafka = kafka.model_copy(update={"allowed_reply_topics": [small, tiny]})
    sampling = SamplingSpec(ignore_eos=True, logprobs=True, top_logprobs=20)
    requests = [
        GenerationRequest(id="long", prompt="Tell a long story.", max_new_tokens=1200, sampling=sampling),
        GenerationRequest(id="small", prompt="Tell a story.", max_new_tokens=200, sampling=sampling,
                          reply_topic=small),
        GenerationRequest(id="tiny", prompt="Tell a story.", max_new_tokens=600, reply_topic=tiny,
                          sampling=SamplingSpec(ignore_eos=True), stream=False),
    ]
    async with Collector(kafka, extra_topics=(small, tiny)) as collector:
        async with running_worker(kafka, worker_settings(chunk_interval_ms=20), tiny_engine(tiny_model_path)):
            await produce_requests(kafka, [(2, r) for r in requests])
            ordinary = await ordinary_stream(kafka, collector, "beside", 20, 0.1)
            await collector.wait_until(lambda r: all(r.finals.get(q.id) for q in requests), 240, "the finals")
            await commits_reach_the_log_end(kafka)
    print(report("ordinary requests beside the large finals", ordinary))
    results = collector.results
    for request_id, topic_limit in (("long", 1_048_588), ("small", 64 * 1024)):
        finals = results.finals[request_id]
        assert len(finals) == 1, [(f.message, f.timings, f.worker_id) for f in finals]
        final = finals[0]
        assert final.status == "completed" and final.omitted == ["logprobs"] and final.logprobs is None
        chunks = results.chunks[(request_id, final.attempt)]
        assert "".join(c.text for c in chunks) == final.text  # the text is whole
        assert [t for c in chunks for t in c.token_ids] == final.token_ids
        # The stream carried every token's logprobs, in chunks within the limit.
        assert sum(len(c.logprobs) for c in chunks) == final.usage.completion_tokens
        assert len(final.token_ids) == final.usage.completion_tokens
    assert len(results.finals["long"][0].token_ids) == 1200
    (tiny_final,) = results.finals["tiny"]
    assert (tiny_final.status, tiny_final.reason) == ("error", "result_too_large"), tiny_final
    assert "2048-byte record limit" in tiny_final.message and tiny_final.usage.completion_tokens == 600


@pytest.mark.slow
async def test_a_reply_topic_the_worker_may_not_write_gets_an_error_final_and_the_partition_moves_on(
        tmp_path, tiny_model_path):
    """A broker with the StandardAuthorizer and an ACL that denies WRITE on one allowed reply topic."""
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient, ResourcePatternType,
                                       ResourceType)

    from worker.broker.local import LocalBroker, free_ports
    from worker.broker.topics import ensure_topics
    from worker.kafka_settings import KafkaSettings

    port, controller_port = free_ports(2)
    broker = LocalBroker(tmp_path / "acl-broker", port, controller_port, detach=False, extra_properties={
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "true",
    })
    broker.start()
    try:
        denied = "reply.denied"
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, allowed_reply_topics=[denied],
                              group_id=f"acl-{uuid.uuid4().hex[:6]}")
        await ensure_topics(kafka)
        await create_topic(kafka, denied)
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        # Once a topic has an ACL, "no ACL found" no longer allows the rest: describing it is allowed explicitly,
        # so the worker sees the topic and is refused the write itself.
        acls = [AclBinding(ResourceType.TOPIC, denied, ResourcePatternType.LITERAL, "User:ANONYMOUS", "*",
                           operation, permission)
                for operation, permission in ((AclOperation.WRITE, AclPermissionType.DENY),
                                              (AclOperation.DESCRIBE, AclPermissionType.ALLOW))]
        for future in admin.create_acls(acls).values():
            future.result(timeout=30)
        async with Collector(kafka) as collector:
            async with running_worker(kafka, worker_settings(destination_wait_s=2.0), InstantEngine(max_num_seqs=16)):
                await send_to(kafka, "to-denied", denied)
                ordinary = await ordinary_stream(kafka, collector, "beside", 30, 0.05)
                await collector.wait_until(lambda r: r.finals.get("to-denied"), 30, "the denied topic's final")
                await send_to(kafka, "to-denied-later", denied)
                await collector.wait_until(lambda r: r.finals.get("to-denied-later"), 30, "a later request's final")
                await commits_reach_the_log_end(kafka)
        print(report("ordinary requests beside the denied topic", ordinary))
        for request_id in ("to-denied", "to-denied-later"):
            (final,) = collector.results.finals[request_id]
            assert (final.status, final.reason) == ("error", "reply_topic_unavailable"), final
            assert f"not authorized to WRITE topic '{denied}'" in final.message
        assert percentile(ordinary, 0.99) < 3.0, report("ordinary", ordinary)
    finally:
        broker.stop()


async def test_topics_looked_up_together_leave_no_client_open_once_stopped(kafka_topics):
    """Several destinations are checked at once when a worker starts (its result, status and reply topics): their
    record limits come from one admin client, which stopping closes; none goes on polling the broker."""
    from worker.transport.kafka.destinations import BrokerProbe

    kafka = kafka_topics
    before = {id(c) for c in polling_clients(kafka.bootstrap_servers)}
    probe = BrokerProbe(lambda: None, kafka.client_kwargs())
    limits = await asyncio.gather(*(probe.max_message_bytes(t) for t in (
        kafka.result_topic, kafka.status_topic, kafka.dead_letter_topic, kafka.request_topic)))
    assert all(limit and limit > 0 for limit in limits), limits
    await probe.close()
    assert [c for c in polling_clients(kafka.bootstrap_servers) if id(c) not in before] == []
