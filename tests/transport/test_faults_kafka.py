"""Faults that real deployments meet, through the real broker: a request topic whose partitions do not match
the configured priority layout, a producer whose clock runs behind, and a request that makes the engine fail."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from worker.broker.topics import ensure_topics
from worker.engine.api import EngineRequest
from worker.engine.instant import InstantEngine, expected_text
from worker.transport.worker import Worker
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.real_producers import produce_librdkafka, request_partition, wait_until_committed_to_end

pytestmark = pytest.mark.kafka


async def test_a_request_topic_that_does_not_match_the_layout_is_refused_at_start(kafka_settings, caplog):
    grown = kafka_settings.model_copy(update={"partitions_per_priority": 3})  # 9 partitions on the broker
    await ensure_topics(grown)
    caplog.set_level(logging.ERROR, logger="worker.transport.worker")
    worker = Worker(kafka_settings, worker_settings(), InstantEngine())  # configured for 3 x 2 = 6
    assert await asyncio.wait_for(worker.run(), 60) == 2
    (message,) = [r.getMessage() for r in caplog.records if "refusing to start" in r.getMessage()]
    assert "has 9 partitions" in message and "= 6" in message


class RecordingEngine(InstantEngine):
    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, EngineRequest] = {}

    def add_request(self, request):
        self.received[request.request_id.split("#")[0]] = request
        return super().add_request(request)


async def test_a_producer_clock_behind_keeps_its_timings_but_not_a_place_ahead_in_the_queue(kafka_topics):
    kafka = kafka_topics
    engine = RecordingEngine()
    hour_ago_ms = int(time.time() * 1000) - 3_600_000
    body = json.dumps({"id": "late-clock", "prompt": "hi", "max_new_tokens": 2}).encode()
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(max_clock_skew_ms=1000.0), engine):
            sent = time.monotonic()
            await asyncio.to_thread(produce_librdkafka, kafka, "zstd",
                                    [(request_partition(kafka, 1, "late-clock"), b"late-clock", body, hour_ago_ms)])
            await collector.wait_until(lambda r: "late-clock" in r.finals, 30)
    (final,) = collector.results.finals["late-clock"]
    assert final.status == "completed"
    assert final.timings.e2e_ms >= 3_600_000  # measured from the record's timestamp, as the client asked
    assert engine.received["late-clock"].arrival_time >= sent - 1.5  # queue order: at most the allowed skew


class PoisonEngine(InstantEngine):
    """Fails any step while a request whose prompt says POISON runs: the worker must find it and go on."""

    def step(self):
        if any("POISON" in (s.request.prompt or "") for s in self._running.values()):
            raise RuntimeError("kernel fault on this input")
        return super().step()


async def test_a_poison_request_is_dead_lettered_and_the_others_complete_without_repeats(kafka_topics):
    kafka = kafka_topics
    requests = {f"ok-{i}": json.dumps({"id": f"ok-{i}", "prompt": f"fine {i}", "max_new_tokens": 300}).encode()
                for i in range(8)}
    poison = json.dumps({"id": "bad-1", "prompt": "POISON", "max_new_tokens": 4}).encode()
    async with Collector(kafka) as collector:
        engine = PoisonEngine(max_num_seqs=16, step_time_s=0.01)
        async with running_worker(kafka, worker_settings(), engine) as worker:
            items = [(request_partition(kafka, 1, rid), rid.encode(), body, None) for rid, body in requests.items()]
            await asyncio.to_thread(produce_librdkafka, kafka, "none", items)
            await collector.wait_until(lambda r: len(r.chunks) >= len(requests), 10)  # all are streaming
            await asyncio.to_thread(produce_librdkafka, kafka, "none",
                                    [(request_partition(kafka, 1, "bad-1"), b"bad-1", poison, None)])
            await collector.wait_until(lambda r: all(rid in r.finals for rid in [*requests, "bad-1"]), 30)
            state = await wait_until_committed_to_end(kafka, 15)
            assert worker.engine_thread.num_poison_requests == 1
            assert worker.engine_thread.num_replays >= 1  # streams that were under way started over, unseen
    results = collector.results
    (bad,) = results.finals["bad-1"]
    assert (bad.status, bad.reason) == ("error", "poison_request") and "kernel fault" in bad.message
    (dead,) = [d for d in results.dead_letters if d.request_id == "bad-1"]
    assert dead.error_code == "poison_request"
    for rid in requests:
        (final,) = results.finals[rid]
        assert final.status == "completed", final
        chunks = results.chunks[(rid, final.attempt)]
        assert [c.seq for c in chunks] == list(range(final.num_chunks))  # no gap, no repeat
        expected = expected_text(EngineRequest(rid, prompt=f"fine {int(rid.split('-')[1])}",
                                               sampling=_sampling(300)))
        assert "".join(c.text for c in chunks) == final.text == expected
    assert all(committed == end for committed, end in state.values()), state


def _sampling(max_new_tokens: int):
    from worker.engine.api import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens)
