"""Records compressed by a librdkafka producer with every codec Kafka supports are served; a batch this
process cannot read (its codec made unavailable here) becomes dead letters, offset by offset, and never holds
up its partition or the others."""

from __future__ import annotations

import asyncio
import json

import aiokafka.codec
import pytest

from worker.engine.instant import InstantEngine
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.real_producers import CODECS, produce_librdkafka, request_partition, wait_until_committed_to_end

pytestmark = pytest.mark.kafka


def request(rid: str) -> bytes:
    return json.dumps({"id": rid, "prompt": f"hello {rid}", "max_new_tokens": 3}).encode()


async def test_every_codec_is_served(kafka_topics):
    kafka = kafka_topics
    ids = {codec: [f"{codec}-{i}" for i in range(20)] for codec in CODECS}
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), InstantEngine()):
            for codec, codec_ids in ids.items():
                items = [(request_partition(kafka, i % 3, rid), rid.encode(), request(rid), None)
                         for i, rid in enumerate(codec_ids)]
                await asyncio.to_thread(produce_librdkafka, kafka, codec, items)
            everything = [rid for codec_ids in ids.values() for rid in codec_ids]
            await collector.wait_until(lambda r: all(rid in r.finals for rid in everything), 30)
            state = await wait_until_committed_to_end(kafka, 15)
    for rid in everything:
        assert [f.status for f in collector.results.finals[rid]] == ["completed"]
    assert collector.results.dead_letters == []
    assert all(committed == end for committed, end in state.values()), state


async def test_a_batch_that_cannot_be_decompressed_is_dead_lettered_offset_by_offset(kafka_topics, monkeypatch):
    kafka = kafka_topics
    # As in a process without the lz4 codec: aiokafka's record reader asks aiokafka.codec at read time.
    monkeypatch.setattr(aiokafka.codec, "has_lz4", lambda: False)
    partition = request_partition(kafka, 1, "x")
    before = [f"before-{i}" for i in range(5)]
    lz4_ids = [f"lz4-{i}" for i in range(30)]
    after = [f"after-{i}" for i in range(5)]
    other = [f"other-{i}" for i in range(10)]  # on other partitions, all the while

    def items(ids, p=partition):
        return [(p, rid.encode(), request(rid), None) for rid in ids]

    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), InstantEngine()):
            await asyncio.to_thread(produce_librdkafka, kafka, "gzip", items(before))
            await asyncio.to_thread(produce_librdkafka, kafka, "lz4", items(lz4_ids), linger_ms=200)
            await asyncio.to_thread(produce_librdkafka, kafka, "gzip", items(after))
            await asyncio.to_thread(produce_librdkafka, kafka, "none",
                                    [(request_partition(kafka, i % 3, rid) if request_partition(kafka, i % 3, rid)
                                      != partition else request_partition(kafka, (i + 1) % 3, rid),
                                      rid.encode(), request(rid), None) for i, rid in enumerate(other)])
            readable = before + after + other
            try:
                await collector.wait_until(
                    lambda r: all(rid in r.finals for rid in readable) and len(r.dead_letters) >= len(lz4_ids), 60)
            except TimeoutError:
                r = collector.results
                missing = [rid for rid in readable if rid not in r.finals]
                raise AssertionError(f"missing finals {missing}; {len(r.dead_letters)} dead letters "
                                     f"{sorted(d.offset for d in r.dead_letters)}") from None
            state = await wait_until_committed_to_end(kafka, 15)
    results = collector.results
    for rid in readable:
        assert [f.status for f in results.finals[rid]] == ["completed"], rid
    assert not any(rid in results.finals for rid in lz4_ids)  # their ids could never be read
    dead = sorted(d.offset for d in results.dead_letters if d.partition == partition)
    assert dead == list(range(len(before), len(before) + len(lz4_ids)))  # each unreadable offset, once
    assert all(d.error_code == "decode_error" and "cannot be read" in d.error_message for d in results.dead_letters)
    assert all(committed == end for committed, end in state.values()), state
