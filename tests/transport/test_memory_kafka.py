"""Every per-request table is released once its request's final is acknowledged: after a mixed load through a
real broker and the real engine (tiny model), the worker's and the engine's tables are back to empty and the
bounded ones within their bounds, and every request got its one final."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from benchmarks.bench_soak import make_request
from schemas.control import CancelRecord
from schemas.request import SamplingSpec
from schemas.decode import encode
from tests.transport.kafka_helpers import (
    Collector,
    produce_requests,
    running_worker,
    worker_settings,
)
from tests.transport.test_stream_kafka import tiny_engine

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

KINDS = ("plain", "schema", "n2", "logprobs", "stop", "cancel")


async def test_tables_are_empty_after_a_mixed_load(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    engine = tiny_engine(tiny_model_path)
    # No shedding: the backlog of long requests to cancel would be shed by the wait a cold worker predicts for it
    # (its first steps are slow on a busy machine), and this test is about the tables, not the load.
    settings = worker_settings(cancel_max_ids=16, max_queue_time_s=[0.0, 0.0, 0.0])
    run_id = uuid.uuid4().hex[:6]
    # The requests to cancel run long (they cannot finish first), and their cancels go once each has streamed:
    # the engine's abort and its cleanup run for every one of them.
    requests = [msgspec.structs.replace(make_request(i, "plain", 0, run_id), max_new_tokens=1000,
                                        sampling=SamplingSpec(ignore_eos=True))
                if KINDS[i % len(KINDS)] == "cancel" else make_request(i, KINDS[i % len(KINDS)], 6, run_id)
                for i in range(90)]
    cancelled = {r.id for i, r in enumerate(requests) if KINDS[i % len(KINDS)] == "cancel"}
    async with Collector(kafka) as collector, running_worker(kafka, settings, engine, max_num_seqs=16) as worker:
        await produce_requests(kafka, [(1, r) for r in requests])
        await collector.wait_until(lambda r: all(any(i == rid for i, _ in r.chunks) for rid in cancelled), 60,
                                   "every request to cancel streaming")
        producer = AIOKafkaProducer(**kafka.client_kwargs())
        await producer.start()
        try:
            for request_id in sorted(cancelled):
                await producer.send(kafka.control_topic, encode(CancelRecord(id=request_id)))
            for _ in range(40):  # cancels of ids no request has: remembered, within cancel_max_ids
                await producer.send(kafka.control_topic, encode(CancelRecord(id=f"unknown-{uuid.uuid4().hex}")))
            await producer.flush()
        finally:
            await producer.stop()

        def all_answered(results) -> bool:
            return all(any(f.index is None for f in results.finals.get(r.id, ())) for r in requests)

        await collector.wait_until(all_answered, 120, "a final for every request")
        for _ in range(100):  # acknowledgements and the commit that follows them
            if worker.tracker.num_pending() == 0 and not worker.tracker.to_commit():
                break
            await asyncio.sleep(0.1)

        results = collector.results
        for r in requests:
            finals = [f for f in results.finals[r.id] if f.index is None]
            assert len(finals) == 1, (r.id, finals)
            expected = "cancelled" if r.id in cancelled else "completed"
            assert finals[0].status == expected, (r.id, finals[0])
            if r.id in cancelled:  # stopped in the engine, mid-stream: its text so far, far short of 1,000 tokens
                assert 0 < finals[0].usage.completion_tokens < 1000 and finals[0].text, finals[0]
            if r.n == 2:
                assert sorted(f.index for f in results.finals[r.id] if f.index is not None) == [0, 1]

        tables = worker.memory.table_sizes()
        assert tables["requests"] == tables["streams"] == tables["local_queue"] == 0, tables
        assert tables["offsets_pending"] == 0, tables
        assert tables["held_completions"] == 0, tables
        assert tables["engine_in_flight"] == 0, tables
        assert tables["cancelled_ids"] <= 16
        assert tables["metric_children"] <= 8
        # The engine's own tables: nothing of a finished request stays.
        assert engine._live == {} and engine.scheduler.requests == {}
        assert engine.structured.num_held == 0 and not engine.structured.has_constrained()
        assert engine.scheduler.pool.num_used_blocks == 0
