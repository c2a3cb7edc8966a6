"""Load protection against a real broker: backpressure pauses and resumes partitions; under several times
the worker's capacity the most urgent priority meets its deadlines while the others are shed or rejected,
and the local queue stays bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.request import GenerationRequest
from worker.engine.instant import InstantEngine
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka


async def sample_paused(worker, seen: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.append({tp.partition for tp in worker.consumer.paused()})
        await asyncio.sleep(0.05)


async def test_partitions_pause_when_the_queue_fills_and_resume_when_it_drains(kafka_topics):
    kafka = kafka_topics
    settings = worker_settings(max_waiting=20, resume_waiting=5, max_poll_records=10, pause_dwell_s=0.2,
                               max_engine_inflight=4, priority_backlog_threshold=100_000,
                               max_queue_time_s=[1e6], status_interval_s=0.1)
    engine = InstantEngine(max_num_seqs=4, step_time_s=0.01)
    requests = [(1 + i % 2, GenerationRequest(id=f"bp-{i}", prompt=f"p{i}", max_new_tokens=4)) for i in range(300)]
    async with Collector(kafka) as collector:
        async with running_worker(kafka, settings, engine, max_num_seqs=4) as worker:
            seen: list[set[int]] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_paused(worker, seen, stop))
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 50)
            await asyncio.sleep(1.5)  # let the pressure fall and the dwell time pass
            stop.set()
            await sampler
            assert worker.consumer.paused() == set()
            # Each priority is fetched while less than max_waiting of it or more urgent work waits.
            assert worker.queue.max_num_waiting_seen <= kafka.num_priorities * (
                settings.max_waiting + settings.max_poll_records)
        statuses = collector.results.statuses
    assert any(s for s in seen), "the consumer never paused a partition"
    first_paused = next(i for i, s in enumerate(seen) if s)
    assert any(not s for s in seen[first_paused:]), "paused partitions never resumed"
    paused_statuses = [s for s in statuses if s.paused_partitions]
    assert paused_statuses
    # Least urgent first: priority 2 pauses first (priority 1 at the same time at most, its work counts
    # for both), and a more urgent priority never pauses without it (the model-free engine reports its
    # seats as KV usage, so KV pressure may pause priority 0 too, after the others).
    assert {4, 5} <= set(paused_statuses[0].paused_partitions)
    assert all({4, 5} <= set(s.paused_partitions) for s in paused_statuses
               if {0, 1, 2, 3} & set(s.paused_partitions))
    assert statuses[-1].paused_partitions == []
    assert all(f[0].status == "completed" for f in collector.results.finals.values())


async def produce_paced(kafka, requests_by_tick: list[list[tuple[int, GenerationRequest]]], tick_s: float) -> None:
    for batch in requests_by_tick:
        started = time.monotonic()
        await produce_requests(kafka, batch)
        await asyncio.sleep(max(0.0, tick_s - (time.monotonic() - started)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_overload_keeps_urgent_deadlines_and_sheds_the_rest(kafka_topics):
    """Urgent traffic at a quarter of capacity, first alone (its unloaded latency), then beside bulk traffic at
    several times capacity: the urgent requests all complete, their p95 stays near the unloaded one (not merely
    under a deadline a hundred times their service time), the bulk is shed or rejected, and the worker keeps
    serving near its capacity (goodput) instead of thrashing. Counted by tick: the four urgent requests of a tick
    arrive together, so one hiccup of the host (the broker, this process and the worker share two cores) delays a
    whole tick by 100-300 ms, and three or four such ticks in 30 happen on a busy host (they set the p90 of the
    120 requests). Urgent requests served behind the bulk queue (64 waiting at 160 requests/s: 400 ms) would move
    every tick: so at most one tick in six may be slow, and the median holds."""
    kafka = kafka_topics
    # Capacity: 8 sequences x 5 tokens x 10 ms steps, about 160 requests/s. Urgent: 40/s. Bulk: about 520/s.
    settings = worker_settings(max_waiting=64, resume_waiting=32, max_poll_records=32, pause_dwell_s=0.2,
                               priority_backlog_threshold=8, max_queue_time_s=[10.0, 1.0, 1.0])
    engine = InstantEngine(max_num_seqs=8, step_time_s=0.01)

    def urgent(t: int, phase: str) -> list:
        return [(0, GenerationRequest(id=f"u{phase}-{t}-{i}", prompt=f"urgent {phase} {t} {i}", max_new_tokens=5,
                                      timeout_ms=1000)) for i in range(4)]

    alone = [urgent(t, "a") for t in range(20)]
    ticks = []
    for t in range(30):
        ticks.append(urgent(t, "o") + [
            (1 + i % 2, GenerationRequest(id=f"b-{t}-{i}", prompt=f"bulk {t} {i}", max_new_tokens=5,
                                          timeout_ms=2000)) for i in range(52)])
    alone_ids = [r.id for batch in alone for _, r in batch]
    all_ids = [r.id for batch in ticks for _, r in batch]
    async with Collector(kafka) as collector:
        async with running_worker(kafka, settings, engine, max_num_seqs=8) as worker:
            await produce_paced(kafka, alone, tick_s=0.1)
            await collector.wait_until(lambda r: all(i in r.finals for i in alone_ids), 30)
            started = time.monotonic()
            await produce_paced(kafka, ticks, tick_s=0.1)
            await collector.wait_until(lambda r: all(i in r.finals for i in all_ids), 50)
            served_s = time.monotonic() - started
            assert worker.queue.max_num_waiting_seen <= kafka.num_priorities * (
                settings.max_waiting + settings.max_poll_records)
        results = collector.results
    for rid in all_ids:
        assert len(results.finals[rid]) == 1, rid
    unloaded = [results.finals[i][0].timings.e2e_ms for i in alone_ids[len(alone_ids) // 2:]]  # warmed up
    urgent_finals = [results.finals[i][0] for i in all_ids if i.startswith("uo-")]
    assert all(f.status == "completed" for f in urgent_finals)
    loaded = [f.timings.e2e_ms for f in urgent_finals]
    loaded_p90, unloaded_p90 = percentile(loaded, 0.9), percentile(unloaded, 0.9)
    bound = max(3 * unloaded_p90, unloaded_p90 + 250.0)
    slowest_by_tick: dict[str, float] = {}
    for f in urgent_finals:
        tick = f.id.rsplit("-", 1)[0]
        slowest_by_tick[tick] = max(slowest_by_tick.get(tick, 0.0), f.timings.e2e_ms)
    slow_ticks = sorted(v for v in slowest_by_tick.values() if v > bound)
    assert len(slowest_by_tick) == 30 and len(slow_ticks) <= 5, (slow_ticks, bound)
    loaded_p50, unloaded_p50 = percentile(loaded, 0.5), percentile(unloaded, 0.5)
    assert loaded_p50 <= max(2 * unloaded_p50, unloaded_p50 + 100.0), (loaded_p50, unloaded_p50)
    assert max(loaded) <= 1000.0  # every one within its deadline
    bulk = [results.finals[i][0] for i in all_ids if i.startswith("b-")]
    reasons = {f.reason for f in bulk if f.status == "rejected"}
    assert len([f for f in bulk if f.status == "rejected"]) > len(bulk) // 3
    assert reasons <= {"shed", "deadline"} and reasons
    assert all(f.status in ("completed", "rejected") for f in bulk)
    # Goodput: output tokens of completed requests over the overload, against 800 tokens/s of capacity.
    tokens = sum(results.finals[i][0].usage.completion_tokens for i in all_ids
                 if results.finals[i][0].status == "completed")
    assert tokens / served_s >= 0.5 * 800, (tokens, served_s)
    print(f"\nurgent p50 {loaded_p50:.0f} ms, p90 {loaded_p90:.0f} ms (p99 {percentile(loaded, 0.99):.0f}) under "
          f"overload; {unloaded_p50:.0f} and {unloaded_p90:.0f} ms alone; goodput "
          f"{tokens / served_s:.0f} tokens/s of 800")
