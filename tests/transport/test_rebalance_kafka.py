"""Scale events through the real broker with workers as processes (the model-free engine, so texts are known
exactly): a worker joining two busy ones, one of three leaving with SIGTERM, and a rolling restart of all
three under load. The work of partitions that stay with their owner is never restarted: it streams on under
its first attempt with contiguous chunks; only the requests of partitions that moved run again, under a
higher attempt."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from schemas.priority import partition_for
from schemas.request import GenerationRequest
from worker.engine.instant import expected_text
from tests.transport.exactly_once_checks import committed_offsets
from tests.transport.kafka_helpers import Collector, WaitTimeout, produce_requests, start_worker_process
from tests.transport.test_failover_kafka import wait_assigned
from tests.transport.test_stream_kafka import as_engine_request

pytestmark = pytest.mark.kafka

STEP_MS = 20
ARGS = ["--engine", "instant", "--instant-step-ms", str(STEP_MS)]


def make_requests(prefix: str, n: int, max_new_tokens: int) -> list[tuple[int, GenerationRequest]]:
    return [(i % 3, GenerationRequest(id=f"{prefix}-{i}", prompt=f"{prefix} prompt {i}", max_new_tokens=max_new_tokens))
            for i in range(n)]


def owners(collector: Collector, live: set[str] | None = None) -> dict[int, str]:
    """partition -> worker id, from each (live) worker's latest status record."""
    latest = {}
    for status in collector.results.statuses:
        latest[status.worker_id] = status
    return {p: wid for wid, s in latest.items() if live is None or wid in live for p in s.assigned_partitions}


def attempts_of(results, request_id: str) -> set[int]:
    """Attempts that published anything (a chunk or a final) for this request."""
    return {f.attempt for f in results.finals.get(request_id, [])} | {
        a for (i, a) in results.chunks if i == request_id}


async def unanswered(kafka, collector: Collector, written: dict[str, tuple[int, int]]) -> str:
    """Where the requests without a final are: partition, offset, the attempts that published anything, and
    the group's committed offset of that partition (past the record: it was skipped, not just slow)."""
    committed = await committed_offsets(kafka)
    missing = sorted((p, o, i) for i, (p, o) in written.items() if i not in collector.results.finals)
    return "unanswered: " + "; ".join(
        f"{i} at {p}:{o} attempts {sorted(attempts_of(collector.results, i))} committed {committed.get(p)}"
        for p, o, i in missing)


async def wait_all_completed(kafka, collector: Collector, requests, written: dict[str, tuple[int, int]],
                             timeout_s: float = 90) -> None:
    """Until every request has a completed final; on a timeout, where the unanswered ones sit (unanswered)."""
    try:
        await collector.wait_until(lambda r: all_completed(r, requests), timeout_s)
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc}\n{await unanswered(kafka, collector, written)}") from None


def check_served_once_per_attempt(results, requests) -> None:
    """Every request completed; its latest attempt streamed once, in order, the exact text; no attempt has two
    finals."""
    for _, request in requests:
        final = results.latest_final(request.id)
        assert final.status == "completed", final
        chunks = results.stream_of(final)  # a resumed attempt's, with the chunks below resumed_at
        assert [c.seq for c in chunks] == list(range(final.num_chunks)), request.id
        assert "".join(c.text for c in chunks) == final.text == expected_text(as_engine_request(request))
        per_attempt = [f.attempt for f in results.finals[request.id]]
        assert len(per_attempt) == len(set(per_attempt)), request.id


def partition_of(kafka, priority: int, request: GenerationRequest) -> int:
    return partition_for(priority, request.id, kafka.num_request_partitions, kafka.num_priorities)


async def start(kafka, name: str, tmp_path: Path, **settings):
    return await start_worker_process(kafka, [*ARGS, "--worker-id", name], tmp_path / f"{name}.log", **settings)


async def stop_all(procs) -> list[int]:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    return [await asyncio.wait_for(p.wait(), 60) for p in procs]


def all_running(results, requests) -> bool:
    return all(any(i == q.id for (i, _) in results.chunks) for _, q in requests)


def all_completed(results, requests) -> bool:
    return all(any(f.status == "completed" for f in results.finals.get(q.id, [])) for _, q in requests)


async def test_a_joining_worker_restarts_only_the_requests_of_partitions_that_moved(kafka_topics, tmp_path):
    kafka = kafka_topics
    requests = make_requests("join", 36, 300)  # 300 steps of 20 ms: 6 s each, all running at once
    async with Collector(kafka) as collector:
        procs = [await start(kafka, f"w{i}", tmp_path) for i in (1, 2)]
        try:
            await wait_assigned(collector, {"w1", "w2"}, kafka.num_request_partitions)
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: all_running(r, requests), 30)
            before = owners(collector)
            procs.append(await start(kafka, "w3", tmp_path))
            await wait_assigned(collector, {"w1", "w2", "w3"}, kafka.num_request_partitions)
            after = owners(collector)
            moved_now = {p for p in before if after.get(p) != before[p]}
            in_flight_moved = [q.id for p, q in requests if partition_of(kafka, p, q) in moved_now
                               and not collector.results.finals.get(q.id)]
            await collector.wait_until(lambda r: all_completed(r, requests), 60)
        finally:
            codes = await stop_all(procs)
    assert codes == [0, 0, 0]
    results = collector.results
    check_served_once_per_attempt(results, requests)
    moved = {p for p in before if after.get(p) != before[p]}
    assert len(moved) == 2, (before, after)  # sticky: w3 takes one partition from each, no more
    on_moved = [q for p, q in requests if partition_of(kafka, p, q) in moved]
    restarted = [q for _, q in requests if len(attempts_of(results, q.id)) > 1]
    retained_restarted = [q.id for q in restarted if q not in on_moved]
    print(f"join: {len(requests)} requests, {len(on_moved)} on the {len(moved)} moved partitions, "
          f"{len(restarted)} restarted, {len(retained_restarted)} of them on retained partitions")
    assert retained_restarted == []
    assert len(restarted) <= len(on_moved)
    # The join moved work in flight (else the test passes with nothing restarted, proving nothing).
    assert in_flight_moved and restarted, (in_flight_moved, restarted)
    for _, q in requests:
        if q not in on_moved:  # kept: one attempt, from the first chunk to the final
            (attempt,) = attempts_of(results, q.id)
            assert results.latest_final(q.id).attempt == attempt


async def test_a_worker_leaving_restarts_none_of_the_others_requests(kafka_topics, tmp_path):
    kafka = kafka_topics
    requests = make_requests("leave", 36, 300)
    async with Collector(kafka) as collector:
        procs = [await start(kafka, f"w{i}", tmp_path, drain_timeout_s=0.3) for i in (1, 2, 3)]
        try:
            await wait_assigned(collector, {"w1", "w2", "w3"}, kafka.num_request_partitions)
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: all_running(r, requests), 30)
            before = owners(collector)
            procs[2].send_signal(signal.SIGTERM)  # a 0.3 s drain: most of its requests are cut short
            assert await asyncio.wait_for(procs[2].wait(), 30) == 0
            await collector.wait_until(lambda r: all_completed(r, requests), 60)
        finally:
            codes = await stop_all(procs)
    assert codes == [0, 0, 0]
    results = collector.results
    check_served_once_per_attempt(results, requests)
    survivors = {p for p, wid in before.items() if wid != "w3"}
    restarted = [q for _, q in requests if len(attempts_of(results, q.id)) > 1]
    on_survivors = [q for p, q in requests if partition_of(kafka, p, q) in survivors]
    print(f"leave: {len(requests)} requests, {len(requests) - len(on_survivors)} on the leaver's partitions, "
          f"{len(restarted)} restarted, {len([q for q in restarted if q in on_survivors])} of the survivors'")
    assert [q.id for q in restarted if q in on_survivors] == []
    assert restarted, "the leaver's short drain cut requests short; the survivors served them again"


async def test_a_rolling_restart_under_load_loses_nothing_and_restarts_only_the_restarted_workers_work(
        kafka_topics, tmp_path):
    kafka = kafka_topics
    requests = make_requests("roll", 90, 100)  # 2 s each, sent in waves while the workers restart
    waves = [requests[i:i + 5] for i in range(0, len(requests), 5)]  # 18 waves over ~14 s: all three restarts
    async with Collector(kafka) as collector:
        procs = {f"w{i}": await start(kafka, f"w{i}", tmp_path, drain_timeout_s=0.3) for i in (1, 2, 3)}

        written: dict[str, tuple[int, int]] = {}

        async def send_waves() -> None:
            for wave in waves:
                written.update(await produce_requests(kafka, wave))
                await asyncio.sleep(0.8)

        def restarted_now() -> set[str]:
            return {q.id for _, q in requests if len(attempts_of(collector.results, q.id)) > 1}

        windows = []  # per restart: the worker's partitions when stopped, the requests restarted meanwhile
        try:
            await wait_assigned(collector, set(procs), kafka.num_request_partitions)
            sender = asyncio.create_task(send_waves())
            for name in ("w1", "w2", "w3"):
                await asyncio.sleep(1.5)
                already = restarted_now()
                partitions = {p for p, wid in owners(collector, set(procs)).items() if wid == name}
                procs[name].send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(procs[name].wait(), 30) == 0
                del procs[name]
                name += "-again"  # the restarted process reports under its own id, so its first status is its own
                procs[name] = await start(kafka, name, tmp_path, drain_timeout_s=0.3)
                await wait_assigned(collector, set(procs), kafka.num_request_partitions)
                await asyncio.sleep(1.0)  # a restarted request's new attempt streams within a few steps
                windows.append((name, partitions, restarted_now() - already))
            await sender
            await wait_all_completed(kafka, collector, requests, written)
        finally:
            codes = await stop_all(list(procs.values()))
    assert codes == [0, 0, 0]
    results = collector.results
    check_served_once_per_attempt(results, requests)  # nothing lost, nothing twice within an attempt
    partition = {q.id: partition_of(kafka, p, q) for p, q in requests}
    print("rolling restart:", len(requests), "requests;",
          "; ".join(f"{name} (partitions {sorted(ps)}): {len(ids)} restarted" for name, ps, ids in windows))
    # In each restart's window, only requests of that worker's partitions ran again: the others kept theirs
    # (the worker that comes back takes back the partitions the others got last, its own).
    for name, partitions, ids in windows:
        assert {partition[i] for i in ids} <= partitions, (name, partitions, {i: partition[i] for i in ids})
    late = {i: (sorted(attempts_of(results, i)), partition[i]) for i in restarted_now()} if windows else {}
    assert len(restarted_now()) == sum(len(ids) for _, _, ids in windows), late  # none outside the windows
    assert sum(len(ids) for _, _, ids in windows) > 0, "no restart cut a request short: the test proved nothing"
