"""LLMClient against a real broker: streaming through a worker on the instant engine, priority routing,
attempt supersession, gaps, timeouts and status-driven backoff (the last four driven by records written
straight to the topics, as a worker would)."""

from __future__ import annotations

import asyncio
import time

import pytest

from llm_client import BackoffPolicy, ClientError, LLMClient, RequestTimeout, StreamGap
from schemas.decode import decode_request
from schemas.priority import partition_for, partitions_for_priority
from schemas.request import ChatMessage, GenerationRequest
from schemas.status import PriorityStatus, WorkerStatus
from tests.client.helpers import RawProducer, chunk, completed, instant_text, new_id, read_topic
from tests.transport.kafka_helpers import running_worker, worker_settings
from worker.engine.instant import InstantEngine

pytestmark = pytest.mark.kafka


async def test_submit_streams_chunks_in_order_then_the_final(kafka_topics):
    kafka = kafka_topics
    requests = [
        GenerationRequest(id=new_id(), prompt="Why is the sky blue?", max_new_tokens=7),
        GenerationRequest(id=new_id(), messages=[ChatMessage(role="user", content="Hello")], max_new_tokens=4),
        GenerationRequest(id=new_id(), prompt="No stream, please.", max_new_tokens=3, stream=False),
    ]
    async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=8), max_num_seqs=8):
        async with LLMClient(kafka) as client:
            handles = [await client.submit(r, priority=i) for i, r in enumerate(requests)]
            for request, handle in zip(requests, handles):
                deltas = [d async for d in handle.stream(timeout=20)]
                final = await handle.result(timeout=5)
                assert final.status == "completed" and final.reason == "length", final
                assert final.text == instant_text(request)
                if request.stream:
                    assert [d.seq for d in deltas] == list(range(final.num_chunks)) and deltas
                    assert {d.attempt for d in deltas} == {final.attempt}
                    assert not any(d.restarted for d in deltas)
                    assert "".join(d.text for d in deltas) == final.text
                    assert handle.ttft_s is not None and 0 <= handle.ttft_s <= handle.e2e_s
                else:
                    assert deltas == [] and final.num_chunks == 0
            assert client.num_in_flight == 0 and client.num_undecodable == 0


async def test_requests_land_on_their_priority_partitions(kafka_topics):
    kafka = kafka_topics
    ids_by_priority = {p: [new_id(f"p{p}") for _ in range(6)] for p in range(kafka.num_priorities)}
    async with LLMClient(kafka, backoff=BackoffPolicy(enabled=False)) as client:
        for priority, request_ids in ids_by_priority.items():
            for request_id in request_ids:
                handle = await client.submit(GenerationRequest(id=request_id, prompt="x"), priority)
                assert handle.partition == partition_for(priority, request_id, kafka.num_request_partitions,
                                                         kafka.num_priorities)
    records = await read_topic(kafka, kafka.request_topic, 6 * kafka.num_priorities)
    assert len(records) == 6 * kafka.num_priorities
    for record in records:
        request = decode_request(record.value)
        priority = next(p for p, ids in ids_by_priority.items() if request.id in ids)
        assert record.key == request.id.encode()
        assert record.partition in partitions_for_priority(priority, kafka.num_request_partitions,
                                                           kafka.num_priorities)
        assert record.partition == partition_for(priority, request.id, kafka.num_request_partitions,
                                                 kafka.num_priorities)
        assert request.priority == priority
    # Ids spread over more than one partition of a priority (crc32 picks among them).
    assert len({r.partition for r in records}) > kafka.num_priorities


async def test_a_higher_attempt_supersedes_the_stream_seen_so_far(kafka_topics):
    kafka = kafka_topics
    request_id = new_id()
    async with LLMClient(kafka) as client, RawProducer(kafka) as raw:
        handle = await client.submit(GenerationRequest(id=request_id, prompt="x"), priority=0)
        stream = handle.stream(timeout=10)
        await raw.results(chunk(request_id, 3, 0, "old-a"), chunk(request_id, 3, 1, "old-b"))
        seen = [await anext(stream), await anext(stream)]
        assert [(d.attempt, d.seq, d.text, d.restarted) for d in seen] == [(3, 0, "old-a", False),
                                                                          (3, 1, "old-b", False)]
        # The redelivered attempt starts over; a straggler of the old attempt must be ignored.
        await raw.results(chunk(request_id, 5, 0, "new-a"), chunk(request_id, 3, 2, "old-c"),
                          chunk(request_id, 5, 1, "new-b"), completed(request_id, 5, "new-anew-b", 2))
        rest = [d async for d in stream]
        assert [(d.attempt, d.seq, d.text, d.restarted) for d in rest] == [(5, 0, "new-a", True),
                                                                          (5, 1, "new-b", False)]
        final = await handle.result()
        assert final.attempt == 5 and final.text == "new-anew-b"
        assert handle.num_restarts == 1 and handle.num_dropped == 1


async def test_a_superseded_attempt_not_yet_read_is_discarded_unseen(kafka_topics):
    kafka = kafka_topics
    request_id = new_id()
    async with LLMClient(kafka) as client, RawProducer(kafka) as raw:
        handle = await client.submit(GenerationRequest(id=request_id, prompt="x"), priority=2)
        await raw.results(chunk(request_id, 0, 0, "old"), chunk(request_id, 1, 0, "new"),
                          completed(request_id, 1, "new", 1))
        await handle.result(timeout=10)
        deltas = [d async for d in handle.stream()]
        assert [(d.attempt, d.text, d.restarted) for d in deltas] == [(1, "new", False)]


async def test_a_missing_chunk_raises_stream_gap_but_the_final_still_arrives(kafka_topics):
    kafka = kafka_topics
    request_id = new_id()
    async with LLMClient(kafka) as client, RawProducer(kafka) as raw:
        handle = await client.submit(GenerationRequest(id=request_id, prompt="x"), priority=1)
        await raw.results(chunk(request_id, 0, 0, "a"), chunk(request_id, 0, 2, "c"),
                          completed(request_id, 0, "abc", 3))
        final = await handle.result(timeout=10)
        texts = []
        with pytest.raises(StreamGap) as caught:
            async for delta in handle.stream():
                texts.append(delta.text)
        assert texts == ["a"] and (caught.value.expected_seq, caught.value.got_seq) == (1, 2)
        assert final.text == "abc"


async def test_no_answer_raises_request_timeout(kafka_topics):
    kafka = kafka_topics
    async with LLMClient(kafka) as client:
        handle = await client.submit(GenerationRequest(id=new_id(), prompt="nobody listens"), priority=0,
                                     timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(RequestTimeout) as caught:
            await handle.result()
        assert 0.3 <= time.monotonic() - started < 3.0
        assert caught.value.request_id == handle.request_id
        with pytest.raises(RequestTimeout):
            async for _ in handle.stream(timeout=0.2):
                pass
        with pytest.raises(asyncio.TimeoutError):  # RequestTimeout is one, so generic handlers catch it
            await handle.result(timeout=0.1)
        handle.close()
        assert client.num_in_flight == 0


def shedding_status(worker_id: str, shed_priority: int, ts_ms: int) -> WorkerStatus:
    priorities = [PriorityStatus(priority=p, shed=p == shed_priority) for p in range(3)]
    return WorkerStatus(worker_id=worker_id, ts_ms=ts_ms, priorities=priorities, shedding=True)


async def test_submit_backs_off_while_a_worker_sheds_that_priority(kafka_topics):
    kafka = kafka_topics
    policy = BackoffPolicy(base_delay_s=0.1, max_delay_s=0.3, max_total_s=1.2, status_max_age_s=30)
    async with RawProducer(kafka) as raw:
        # A stale report must not throttle: its worker may be long gone.
        await raw.status(shedding_status("gone", 1, int(time.time() * 1000) - 60_000))
        await raw.status(shedding_status("busy", 2, int(time.time() * 1000)))
    async with LLMClient(kafka, backoff=policy) as client:
        assert client.congestion(2) == "worker busy sheds priority 2"
        assert client.congestion(1) is None and client.congestion(0) is None
        for priority in (0, 1):
            started = time.monotonic()
            handle = await client.submit(GenerationRequest(id=new_id(), prompt="x"), priority)
            assert handle.backoff_s == 0.0 and time.monotonic() - started < 2.0
        started = time.monotonic()
        handle = await client.submit(GenerationRequest(id=new_id(), prompt="x"), 2)
        # The report never clears, so submit waits its whole budget and then sends anyway.
        assert 1.2 <= handle.backoff_s <= time.monotonic() - started < 5.0
        # A deadline caps the wait at half the time left before it.
        handle = await client.submit(GenerationRequest(id=new_id(), prompt="x", timeout_ms=400), 2)
        assert 0.1 <= handle.backoff_s <= 0.7
    records = await read_topic(kafka, kafka.request_topic, 4)
    assert len(records) == 4
    # The time spent backing off is taken off timeout_ms: the deadline stays where the caller put it.
    held = [r for r in records if decode_request(r.value).id == handle.request_id]
    sent_timeout = decode_request(held[0].value).timeout_ms
    assert 400 - handle.backoff_s * 1000 - 2 <= sent_timeout <= 400 - handle.backoff_s * 1000 + 2


async def test_backoff_ends_when_the_worker_stops_shedding(kafka_topics):
    kafka = kafka_topics
    policy = BackoffPolicy(base_delay_s=0.05, max_delay_s=0.1, max_total_s=10, status_max_age_s=30)
    async with RawProducer(kafka) as raw, LLMClient(kafka, backoff=policy) as client:
        await raw.status(shedding_status("w1", 1, int(time.time() * 1000)))
        async with asyncio.timeout(10):
            while client.congestion(1) is None:
                await asyncio.sleep(0.05)
        submit = asyncio.create_task(client.submit(GenerationRequest(id=new_id(), prompt="x"), 1))
        await asyncio.sleep(0.6)
        assert not submit.done()
        await raw.status(WorkerStatus(worker_id="w1", ts_ms=int(time.time() * 1000),
                                      priorities=[PriorityStatus(priority=p) for p in range(3)]))
        handle = await asyncio.wait_for(submit, 5)
        assert 0.6 <= handle.backoff_s < 5


async def test_missing_topics_fail_fast_with_a_clear_message(kafka_settings):
    # kafka_settings (not kafka_topics): its topic names are unique and were never created.
    started = time.monotonic()
    with pytest.raises(ClientError, match="does not exist.*llm-worker topics"):
        async with LLMClient(kafka_settings):
            pass
    assert time.monotonic() - started < 10
