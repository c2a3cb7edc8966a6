"""Exactly one final per request with the real default model, where requests finish out of offset order.

Two `llm-worker serve` processes on SmolLM2-135M-Instruct serve requests of mixed prompt and output lengths, so
within a partition short requests finish before long ones read earlier, and their finals are committed above the
partition's watermark. One is SIGKILLed at such a moment: its partitions move, and their new owner starts from
committed offsets whose progress metadata lists answered requests above them, and resumes the streams that were
under way (read back through our client's stitching: whole, no seq twice; greedy and seeded outputs equal an
uninterrupted run). A read_committed reader, and at the end librdkafka's consumer as a third-party client would
read, sees exactly one final per request id, and one usage record each.

The test proves its fault hit what the bug needed: finals committed above a watermark on the partitions that
moved, read back from the group's committed offsets right after the kill and from the new owner's log ("answered
already; skipped"). The frozen zombie and the worker joining mid-stream run the same checks on the fake engine,
whose requests finish out of order the same way (test_exactly_once_kafka.py).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import pytest

from schemas.request import GenerationRequest, SamplingSpec
from worker.usage_report import read_usage, summarize
from tests.transport.exactly_once_checks import (all_answered, answered_above, check_exactly_one,
                                                 committed_offsets, owned_by, skipped_in_log, stop,
                                                 third_party_final_counts, wait_for_answers_above_watermark)
from tests.transport.kafka_helpers import Collector, produce_requests, start_worker_process
from tests.transport.resume_checks import stitch
from tests.transport.test_failover_kafka import wait_assigned

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# The real model as a user runs it, on the CPU; a small running batch keeps a step short on a small, shared CPU host
# while still batching continuously (short requests leave, new ones take their seats).
ENGINE_ENV = {"ENGINE_DEVICE": "cpu", "ENGINE_MAX_NUM_SEQS": "8", "ENGINE_MAX_NUM_BATCHED_TOKENS": "256"}


def mixed_requests(prefix: str, n: int) -> list[tuple[int, GenerationRequest]]:
    """Prompt lengths and output lengths that vary together: a request read later often finishes first."""
    out = []
    for i in range(n):
        words = 4 + (i * 37) % 60
        tokens = (3, 24, 6, 16, 2, 12)[i % 6]
        out.append((i % 3, GenerationRequest(
            id=f"{prefix}-{i}", prompt=f"{prefix} {i}: " + " ".join(["tell me about kafka"] * (words // 4)),
            max_new_tokens=tokens, sampling=SamplingSpec(ignore_eos=True))))
    return out


def long_requests(prefix: str, n: int) -> list[tuple[int, GenerationRequest]]:
    """Greedy and seeded sampled streams of 48 tokens: long enough to be mid-stream at a kill."""
    return [(0, GenerationRequest(
        id=f"{prefix}-{i}", prompt=f"{prefix} {i}: write a story about a worker that never loses a token",
        max_new_tokens=48, sampling=SamplingSpec(ignore_eos=True) if i % 2 == 0 else SamplingSpec(
            ignore_eos=True, temperature=0.8, top_p=0.95, seed=100 + i))) for i in range(n)]


async def start(kafka, name: str, tmp_path: Path, model: Path):
    return await start_worker_process(kafka, ["--model", str(model), "--worker-id", name], tmp_path / f"{name}.log",
                                      drain_timeout_s=0.3)


async def test_one_final_per_request_when_the_real_model_finishes_out_of_order(kafka_topics, tmp_path, smollm2_path,
                                                                                 monkeypatch):
    kafka = kafka_topics
    assert kafka.exactly_once
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    killed = mixed_requests("kill", 48)
    # Longer streams, most urgent, so some are under way when the kill comes: their next owner resumes them.
    long = long_requests("long", 4)
    killed = long + killed
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2")}
    async with Collector(kafka, isolation_level="read_committed") as committed:
        procs = {name: await start(kafka, name, tmp_path, smollm2_path) for name in ("w1", "w2")}
        try:
            await wait_assigned(committed, {"w1", "w2"}, kafka.num_request_partitions, timeout_s=120)

            # SIGKILL while w1's commits record finals above its watermarks.
            offsets = await produce_requests(kafka, killed)
            w1_parts = owned_by(committed, "w1")
            await wait_for_answers_above_watermark(kafka, committed, w1_parts, killed, offsets)
            procs["w1"].send_signal(signal.SIGKILL)
            await procs["w1"].wait()
            await asyncio.sleep(0.5)  # the reader catches up with what w1 committed; nothing moves until w2 takes over
            hit = answered_above(committed, offsets, await committed_offsets(kafka), w1_parts)
            assert hit, "w1 died with no final committed above a committed offset of its partitions"
            await committed.wait_until(lambda r: all_answered(committed, killed), 180, "finals after the kill")
            check_exactly_one(committed, killed, "SIGKILL")
            assert skipped_in_log(logs["w2"]) >= 1, "w2 took w1's partitions over without skipping an answer"
            resumed = await stitch(committed, [q.id for _, q in killed])
            assert not resumed.problems and resumed.repeated_seqs == 0, resumed
            assert resumed.resumed >= 1, f"no stream was resumed after the kill: {resumed}"
            # The resumed outputs against an uninterrupted run of the same requests.
            reference = [(p, msgspec.structs.replace(q, id=f"{q.id}-ref")) for p, q in long]
            await produce_requests(kafka, reference)
            await committed.wait_until(lambda r: all_answered(committed, reference), 180, "the reference finals")
            for _, q in long:
                assert committed.results.latest_final(q.id).token_ids == \
                    committed.results.latest_final(f"{q.id}-ref").token_ids, q.id
        finally:
            await stop(list(procs.values()))
    everything = {q.id for _, q in killed}
    counts = await asyncio.to_thread(third_party_final_counts, kafka, killed)
    assert {i: c for i, c in counts.items() if c != 1} == {}, "librdkafka read_committed: not one final each"

    # Billing: one committed usage record per request, in the finals' transactions: they sum to the finals.
    usage = [u for u in await read_usage(kafka, 0) if u.id in everything]
    per_id = {}
    for record in usage:
        per_id.setdefault(record.id, []).append(record)
    assert {i: len(rs) for i, rs in per_id.items() if len(rs) != 1} == {} and set(per_id) == everything
    finals = {i: committed.results.finals[i][0] for i in everything}
    for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert sum(getattr(u, field) for u in usage) == sum(getattr(f.usage, field) for f in finals.values()), field
    assert all(per_id[i][0].attempt == f.attempt and per_id[i][0].status == f.status for i, f in finals.items())
    rows = summarize(usage)
    assert sum(row.requests for row in rows) == len(everything)
    assert {row.priority for row in rows} == {0, 1, 2}
    print(f"\nreal model, out of order: the SIGKILL came with {sum(hit.values())} finals committed above the "
          f"committed offsets of partitions {sorted(hit)}; {len(everything)} requests, librdkafka read_committed "
          f"saw one final each")
