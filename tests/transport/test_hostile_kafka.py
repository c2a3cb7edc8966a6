"""1,000 hostile records interleaved with valid ones: every valid request completes, every hostile record is
answered with a dead-letter record or an `error` final, and the worker keeps running."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas.decode import encode
from schemas.request import GenerationRequest
from tests.transport.test_stream_kafka import tiny_engine
from tests.transport.kafka_helpers import Collector, produce, running_worker, worker_settings

pytestmark = pytest.mark.kafka

NEAR_BROKER_MAX = 1_000_000  # Kafka's default message.max.bytes is 1,048,588


def hostile(i: int) -> bytes | None:
    """The i-th hostile record value; ids (where there is one) equal the record key f"h-{i}"."""
    rid = f"h-{i}"
    kind = i % 18
    if kind == 0:
        return b"{not json"
    if kind == 1:
        return b""
    if kind == 2:
        return json.dumps({"id": rid, "prompt": 12345}).encode()  # wrong type
    if kind == 3:
        return json.dumps({"id": 5, "prompt": "hello"}).encode()  # id of the wrong type: no id to answer
    if kind == 4:
        return json.dumps({"id": rid, "prompt": ""}).encode()  # empty prompt
    if kind == 5:
        return json.dumps({"id": rid, "prompt": "hi", "max_new_tokens": -5}).encode()
    if kind == 6:
        return json.dumps({"id": rid, "prompt": "hi", "max_new_tokens": 10**15}).encode()
    if kind == 7:
        return b'{"id":"' + rid.encode() + b'","prompt":"\xff\xfe\xfd"}'  # invalid UTF-8
    if kind == 8:
        return json.dumps({"id": rid, "prompt": "hi", "reply_topic": "somebody.elses.topic"}).encode()
    if kind == 9:
        return json.dumps({"id": rid, "prompt": "x" * 250_000}).encode()  # past the prompt limit
    if kind == 10:
        return None  # a tombstone
    if kind == 11:
        return b'{"id":"' + rid.encode() + b'","metadata":' + b"[" * 5000 + b"]" * 5000 + b"}"
    if kind == 12:
        return json.dumps({"id": rid, "messages": [{"role": "wizard", "content": "hi"}]}).encode()
    if kind == 13:
        return json.dumps({"id": rid, "prompt": "hi", "prompt_token_ids": [1, 2]}).encode()  # two prompts
    if kind == 14:
        return json.dumps([1, 2, 3]).encode()
    if kind == 16:  # valid on the wire, refused by the engine: a token id outside the vocabulary
        return json.dumps({"id": rid, "prompt_token_ids": [1, 10**6]}).encode()
    if kind == 17:  # valid on the wire, longer than the model's 2,048 positions once tokenized
        return json.dumps({"id": rid, "prompt": "hello " * 3000}).encode()
    if i % 180 == 15:  # a few records near the broker's size limit (they are slow to move around)
        return json.dumps({"id": rid, "prompt": "y" * NEAR_BROKER_MAX}).encode()
    return json.dumps({"id": rid, "prompt": "hi", "sampling": {"temperature": "hot"}}).encode()


async def test_hostile_records_never_stop_the_worker(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    items = []
    valid_ids = []
    for i in range(1000):
        items.append((i % 3, hostile(i), f"h-{i}"))
        if i % 5 == 0:
            request = GenerationRequest(id=f"ok-{i}", prompt=f"valid {i}", max_new_tokens=3)
            valid_ids.append(request.id)
            items.append((i % 3, encode(request), request.id))
    async with Collector(kafka) as collector:
        engine = tiny_engine(tiny_model_path)
        async with running_worker(kafka, worker_settings(), engine, max_num_seqs=16) as worker:
            await produce(kafka, items)

            def answered(r) -> bool:
                keys = {d.key for d in r.dead_letters}
                hostile_done = all(f"h-{i}".encode() in keys or f"h-{i}" in r.finals for i in range(1000))
                return hostile_done and all(v in r.finals for v in valid_ids)

            await collector.wait_until(answered, 50)
            results = collector.results
            for rid in valid_ids:
                assert [f.status for f in results.finals[rid]] == ["completed"]
            for i in range(1000):
                finals = results.finals.get(f"h-{i}", [])
                assert all(f.status == "error" for f in finals)
            def reasons(kind: int) -> set[str]:
                return {results.finals[f"h-{i}"][0].reason for i in range(1000) if i % 18 == kind}

            assert reasons(8) == {"reply_topic_not_allowed"}
            assert reasons(9) == {"too_large"}
            assert reasons(16) == {"invalid_request"}
            assert reasons(17) == {"prompt_too_long"}
            # The worker is alive and still serving after all that.
            await produce(kafka, [(0, encode(GenerationRequest(id="after", prompt="still there?")), "after")])
            await collector.wait_until(lambda r: "after" in r.finals, 20)
            assert not worker.stopping.is_set()
            assert worker.answers.num_dead_letters >= 300
            await asyncio.sleep(0.5)
            assert worker.tracker.num_pending() == 0  # every hostile offset counted as done
