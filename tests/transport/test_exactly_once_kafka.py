"""Exactly one visible final per request (KAFKA_EXACTLY_ONCE, on by default), against the real broker: a
read_committed consumer of the results sees one final per request id across attempts when a worker is
SIGKILLed mid-stream, when a worker joins while finals are in flight, when a worker frozen (SIGSTOP) past its
session timeout resumes and writes its late finals (fenced: never visible), and when the broker restarts
mid-stream. Every request still ends with a final. A read_uncommitted consumer beside it shows what the
transactions hide."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import pytest

from schemas.request import GenerationRequest
from worker.broker.local import LocalBroker, free_ports
from worker.broker.topics import ensure_topics
from worker.config import KafkaSettings
from tests.transport.kafka_helpers import Collector, produce_requests, start_worker_process
from tests.transport.test_failover_kafka import wait_assigned

pytestmark = pytest.mark.kafka

ARGS = ["--engine", "instant", "--instant-step-ms", "20"]


def requests_of(prefix: str, n: int, max_new_tokens: int = 40) -> list[tuple[int, GenerationRequest]]:
    return [(i % 3, GenerationRequest(id=f"{prefix}-{i}", prompt=f"{prefix} {i}", max_new_tokens=max_new_tokens))
            for i in range(n)]


def final_counts(collector: Collector, requests) -> dict[str, int]:
    return {q.id: len(collector.results.finals.get(q.id, [])) for _, q in requests}


def all_answered(collector: Collector, requests) -> bool:
    return all(collector.results.finals.get(q.id) for _, q in requests)


def check_exactly_one(committed: Collector, uncommitted: Collector, requests, what: str) -> str:
    counts = final_counts(committed, requests)
    duplicates = {i: c for i, c in counts.items() if c > 1}
    missing = [i for i, c in counts.items() if c == 0]
    assert not duplicates and not missing, (what, duplicates, missing)
    for _, q in requests:
        (final,) = committed.results.finals[q.id]
        assert final.status == "completed", (what, final)
        chunks = committed.results.chunks[(q.id, final.attempt)]
        assert "".join(c.text for c in chunks) == final.text, (what, q.id)  # the stream is whole, in order
    seen = final_counts(uncommitted, requests)
    extra = sum(c - 1 for c in seen.values() if c > 1)
    return (f"{what}: {len(requests)} requests, read_committed 0 duplicate / 0 missing finals; "
            f"read_uncommitted saw {extra} extra finals on {sum(1 for c in seen.values() if c > 1)} ids")


async def run_worker(kafka, name: str, tmp_path: Path):
    return await start_worker_process(kafka, [*ARGS, "--worker-id", name], tmp_path / f"{name}.log",
                                      drain_timeout_s=0.3)


async def stop(procs) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
    await asyncio.gather(*(asyncio.wait_for(p.wait(), 60) for p in procs))


async def test_one_final_per_request_across_a_sigkill_a_rebalance_and_a_frozen_zombie(kafka_topics, tmp_path):
    kafka = kafka_topics
    assert kafka.exactly_once
    killed = requests_of("kill", 60)
    joined = requests_of("join", 60, max_new_tokens=100)  # 2 s each: in flight when w3 joins
    frozen = requests_of("freeze", 60, max_new_tokens=200)  # 4 s each: w2 is mid-stream when frozen
    figures = []
    async with Collector(kafka, isolation_level="read_committed") as committed, Collector(kafka) as uncommitted:
        procs = {name: await run_worker(kafka, name, tmp_path) for name in ("w1", "w2")}
        try:
            await wait_assigned(committed, {"w1", "w2"}, kafka.num_request_partitions)
            # SIGKILL mid-stream: w1's requests run again on w2; what w1 wrote in its open transactions is aborted.
            await produce_requests(kafka, killed)
            await asyncio.sleep(1.0)
            procs["w1"].send_signal(signal.SIGKILL)
            await procs["w1"].wait()
            await committed.wait_until(lambda r: all_answered(committed, killed), 90, "finals after the kill")
            procs["w1b"] = await run_worker(kafka, "w1b", tmp_path)
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions)

            # A rebalance while finals are in flight: w3 joins and takes partitions from both.
            await produce_requests(kafka, joined)
            await asyncio.sleep(1.0)
            procs["w3"] = await run_worker(kafka, "w3", tmp_path)
            await wait_assigned(committed, {"w1b", "w2", "w3"}, kafka.num_request_partitions)
            await committed.wait_until(lambda r: all_answered(committed, joined), 90, "finals after the join")
            procs["w3"].send_signal(signal.SIGTERM)
            await procs["w3"].wait()
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions)

            # A zombie: w2 frozen past its session timeout while it holds requests; w1b takes every partition and
            # answers them; w2 resumes and writes its late finals, which its fenced transactions never show.
            await produce_requests(kafka, frozen)
            await asyncio.sleep(1.0)
            procs["w2"].send_signal(signal.SIGSTOP)
            await wait_assigned(committed, {"w1b"}, kafka.num_request_partitions, timeout_s=60)
            await committed.wait_until(lambda r: all_answered(committed, frozen), 90, "finals while w2 is frozen")
            procs["w2"].send_signal(signal.SIGCONT)
            await asyncio.sleep(8.0)  # its resumed loop writes what it held, then learns it was fenced
        finally:
            await stop([p for name, p in procs.items() if name != "w1"])
    figures.append(check_exactly_one(committed, uncommitted, killed, "SIGKILL"))
    figures.append(check_exactly_one(committed, uncommitted, joined, "a worker joining mid-stream"))
    figures.append(check_exactly_one(committed, uncommitted, frozen, "SIGSTOP zombie"))
    print("\n" + "\n".join(figures))


@pytest.mark.slow
async def test_one_final_per_request_across_a_broker_restart(tmp_path):
    port, controller_port = free_ports(2)
    broker = LocalBroker(tmp_path / "broker", port, controller_port, detach=False)
    suffix = uuid.uuid4().hex[:8]
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, request_topic=f"eos.requests.{suffix}",
                          result_topic=f"eos.results.{suffix}", dead_letter_topic=f"eos.dead-letter.{suffix}",
                          status_topic=f"eos.status.{suffix}", control_topic=f"eos.control.{suffix}",
                          group_id=f"eos-{suffix}")
    requests = requests_of("restart", 60, max_new_tokens=60)
    await asyncio.to_thread(broker.start)
    proc = None
    try:
        await ensure_topics(kafka)
        async with Collector(kafka, isolation_level="read_committed") as committed, Collector(kafka) as uncommitted:
            proc = await run_worker(kafka, "eos", tmp_path)
            await wait_assigned(committed, {"eos"}, kafka.num_request_partitions)
            await produce_requests(kafka, requests)
            await asyncio.sleep(1.0)
            assert await asyncio.to_thread(broker.stop)
            await asyncio.sleep(5.0)
            await asyncio.to_thread(broker.start)
            restarted = time.monotonic()
            await committed.wait_until(lambda r: all_answered(committed, requests), 120, "finals after the restart")
            answered_s = time.monotonic() - restarted
            await asyncio.sleep(2.0)
        print("\n" + check_exactly_one(committed, uncommitted, requests, "broker restart")
              + f"; all answered {answered_s:.1f} s after the broker came back")
    finally:
        if proc is not None:
            await stop([proc])
        await asyncio.to_thread(broker.stop)
