"""Overload promises through the real broker: a deadline ends running work (with the text so far), an
urgent request does not wait behind a cap full of less urgent work, and shedding is announced on the status
topic at once, not at the next status interval."""

from __future__ import annotations

import time

import pytest

from llm_client import BackoffPolicy, LLMClient
from schemas.request import GenerationRequest
from worker.engine.dynamic import DynamicEngine
from worker.engine.instant import InstantEngine
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka


class OptimisticEngine(InstantEngine):
    """Reports no step time, so admission predicts every deadline met: the deadline must stop it while running."""

    def stats(self):
        stats = super().stats()
        stats.step_time_base_s = 0.0
        return stats


async def test_a_deadline_stops_a_running_request_with_its_text_so_far(kafka_topics):
    kafka = kafka_topics
    request = GenerationRequest(id="long", prompt="go on", max_new_tokens=2000, timeout_ms=1500)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), OptimisticEngine(step_time_s=0.01)):
            await produce_requests(kafka, [(1, request)])
            await collector.wait_until(lambda r: "long" in r.finals, 20)
    (final,) = collector.results.finals["long"]
    assert (final.status, final.reason) == ("rejected", "deadline")
    assert 0 < final.usage.completion_tokens < 2000 and len(final.token_ids) == final.usage.completion_tokens
    assert final.text == collector.results.stream_text("long", final.attempt)  # what was streamed, in full
    assert 1500 <= final.timings.e2e_ms < 3000  # stopped at the deadline, not run to the end


async def test_urgent_requests_pass_a_cap_full_of_bulk_work_and_shedding_is_announced_at_once(kafka_topics):
    kafka = kafka_topics
    settings = worker_settings(max_engine_inflight=8, status_interval_s=60.0, max_queue_time_s=[60.0, 60.0, 0.5])
    # Preemption is not free here: a bulk request that gives its seat to an urgent one pays, when seated again,
    # for its prompt and every token it had (0.5 ms each), as the real engine recomputes them.
    engine = DynamicEngine(max_num_seqs=8, step_time_s=0.02, per_seq_s=0.0, prefill_s_per_token=0.0005,
                           eos_probability=0.0)
    bulk = [(2, GenerationRequest(id=f"bulk-{i}", prompt=f"bulk {i}", max_new_tokens=200)) for i in range(40)]
    urgent = [(0, GenerationRequest(id=f"urgent-{i}", prompt=f"urgent {i}", max_new_tokens=5)) for i in range(4)]
    async with Collector(kafka) as collector:
        async with running_worker(kafka, settings, engine, max_num_seqs=8):
            await produce_requests(kafka, bulk)
            await collector.wait_until(lambda r: len(r.chunks) >= 8, 20)  # the cap is full of bulk work
            sent = time.monotonic()
            await produce_requests(kafka, urgent)
            await collector.wait_until(lambda r: all(q.id in r.finals for _, q in urgent), 20)
            urgent_s = time.monotonic() - sent
            # A producer using our client reads that record and holds its priority-2 requests back.
            async with LLMClient(kafka, backoff=BackoffPolicy(max_total_s=0.5, status_max_age_s=120)) as client:
                congestion = client.congestion(2)
                handle = await client.submit(GenerationRequest(id="held", prompt="later", max_new_tokens=1), 2)
            await collector.wait_until(lambda r: all(q.id in r.finals for _, q in bulk), 60)
        statuses = collector.results.statuses
    for _, q in urgent:
        assert collector.results.finals[q.id][0].status == "completed"
    # The preempted bulk requests resumed where they were: whole, each stream contiguous, none shed once running.
    for _, q in bulk:
        final = collector.results.latest_final(q.id)
        if final.status == "completed":
            assert final.usage.completion_tokens == 200
            assert [c.seq for c in collector.results.chunks[(q.id, final.attempt)]] == list(range(final.num_chunks))
    # Five tokens at 20 ms a step: well under a second, where waiting for a bulk request (200 steps) takes 4 s.
    assert urgent_s < 2.0, urgent_s
    # The periodic status goes out once a minute here: a record saying priority 2 is shed came on the change.
    assert any(p.shed for s in statuses for p in s.priorities if p.priority == 2)
    # Shed, or paused once the shed backlog was answered and the rest still waits: either holds p2 back.
    assert congestion is not None and ("sheds priority 2" in congestion or "paused partitions [4, 5]" in congestion)
    assert 0.3 <= handle.backoff_s <= 1.0  # held back for its whole budget (the worker still shed p2), then sent
