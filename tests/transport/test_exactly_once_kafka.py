"""Exactly one visible final per request (KAFKA_EXACTLY_ONCE, on by default), against the real broker, on the fake
engine with the real one's dynamics (worker/engine/dynamic.py): requests of varied lengths that finish out of
offset order, so finals are committed above their partition's committed offset, where a new owner starts.

A read_committed reader of the results sees one final per request id when a worker is SIGKILLed, when a worker
joins while requests run, when a worker frozen (SIGSTOP) past its session timeout resumes and writes its late
finals (fenced: never visible), and (test_security_kafka) when the broker restarts. Each case first waits, from
outside the workers, until a final is committed above a committed offset of the partitions the fault moves
while requests of them are still unanswered (exactly_once_checks.py), and asserts after it that the fault hit:
the survivor skipped what was answered, the zombie was fenced, the joiner joined before the work ended. The real
model does the same in test_exactly_once_real_kafka.py."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from schemas.request import GenerationRequest
from tests.transport.exactly_once_checks import (all_answered, check_exactly_one, freeze_with_answers_above,
                                                 owned_by, skipped_in_log, stop, third_party_final_counts,
                                                 unanswered_on, wait_for_answers_above_watermark,
                                                 wait_until_fenced)
from tests.transport.kafka_helpers import Collector, produce_requests, start_worker_process
from tests.transport.test_failover_kafka import wait_assigned

pytestmark = pytest.mark.kafka

# 10 ms steps plus 1 ms a running request: a 60-token request takes about a second at a batch of 16.
ARGS = ["--engine", "fake", "--fake-step-ms", "10"]


def requests_of(prefix: str, n: int, longest: int = 60) -> list[tuple[int, GenerationRequest]]:
    """Varied prompts and lengths (and the fake engine's early stops): a request read later often ends first.
    Every seventh asks for two completions: each has a final of its own, which must be written once too."""
    return [(i % 3, GenerationRequest(id=f"{prefix}-{i}", prompt=f"{prefix} {i} " + "x" * (i * 37 % 200),
                                      max_new_tokens=(longest, 4, longest // 2, 8, longest // 4, 2)[i % 6],
                                      n=2 if i % 7 == 3 else 1))
            for i in range(n)]


async def run_worker(kafka, name: str, tmp_path: Path):
    return await start_worker_process(kafka, [*ARGS, "--worker-id", name], tmp_path / f"{name}.log",
                                      drain_timeout_s=0.3)


async def test_one_final_per_request_across_a_sigkill_a_rebalance_and_a_frozen_zombie(kafka_topics, tmp_path):
    kafka = kafka_topics
    assert kafka.exactly_once
    killed = requests_of("kill", 90)
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2", "w1b", "w3")}
    async with Collector(kafka, isolation_level="read_committed") as committed:
        procs = {name: await run_worker(kafka, name, tmp_path) for name in ("w1", "w2")}
        try:
            await wait_assigned(committed, {"w1", "w2"}, kafka.num_request_partitions)
            # SIGKILL with finals committed above w1's committed offsets: w2 must skip those, redo the rest.
            offsets = await produce_requests(kafka, killed)
            await wait_for_answers_above_watermark(kafka, committed, owned_by(committed, "w1"), killed, offsets)
            procs["w1"].send_signal(signal.SIGKILL)
            await procs["w1"].wait()
            await committed.wait_until(lambda r: all_answered(committed, killed), 90, "finals after the kill")
            check_exactly_one(committed, killed, "SIGKILL")
            assert skipped_in_log(logs["w2"]) >= 1, "w2 took w1's partitions over without skipping an answer"
            procs["w1b"] = await run_worker(kafka, "w1b", tmp_path)
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions)

            # A zombie: w2 frozen past its session timeout while it runs requests with finals committed above
            # its committed offsets; w1b takes every partition and answers; w2 resumes and is fenced.
            # Up to 4 s a request: w2 still runs some when frozen.
            frozen, w2_parts = await freeze_with_answers_above(
                procs["w2"], kafka, committed, "w2",
                lambda attempt: requests_of(f"freeze{attempt}", 90 if attempt == 0 else 30, longest=200))
            held = unanswered_on(committed, frozen, kafka, w2_parts)
            await wait_assigned(committed, {"w1b"}, kafka.num_request_partitions, timeout_s=60)
            await committed.wait_until(lambda r: all_answered(committed, frozen), 90, "finals while w2 is frozen")
            procs["w2"].send_signal(signal.SIGCONT)
            await wait_until_fenced(logs["w2"])
            check_exactly_one(committed, frozen, "SIGSTOP zombie")
            assert held >= 3 and "are fenced" in logs["w2"].read_text(errors="replace")
            assert skipped_in_log(logs["w1b"]) >= 1, "w1b took w2's partitions over without skipping an answer"
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions, timeout_s=60)

            # A worker joins under steady traffic: the partitions it takes are given up with requests running,
            # long ones (up to 4 s) read before short ones, so short ones are answered above the committed offset.
            procs["w3"] = await run_worker(kafka, "w3", tmp_path)
            joined: list = []
            while not owned_by(committed, "w3"):
                batch = requests_of(f"join{len(joined)}", 12, longest=200)
                await produce_requests(kafka, batch)
                joined += batch
                await asyncio.sleep(0.3)
            await wait_assigned(committed, {"w1b", "w2", "w3"}, kafka.num_request_partitions)
            in_flight = sum(1 for _, q in joined if not committed.results.finals.get(q.id))
            tail = requests_of("join-after", 12)
            await produce_requests(kafka, tail)
            joined += tail
            await committed.wait_until(lambda r: all_answered(committed, joined), 90, "finals after the join")
            check_exactly_one(committed, joined, "a worker joining mid-stream")
            assert in_flight > 0, "the join came after every request was answered: it moved nothing in flight"
            assert skipped_in_log(logs["w3"]) >= 1, "w3 took partitions over without skipping an answer"
        finally:
            await stop(list(procs.values()))
    counts = await asyncio.to_thread(third_party_final_counts, kafka, killed + frozen + joined)
    assert {i: c for i, c in counts.items() if c != 1} == {}, "librdkafka read_committed: not one final each"


# A broker restart mid-stream, with exactly one committed final each: test_security_kafka's SASL_SSL broker
# restart (the same requests and checks, every TLS connection and SASL login made again).
