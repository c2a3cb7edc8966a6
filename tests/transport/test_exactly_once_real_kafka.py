"""Exactly one final per request with the real default model, where requests finish out of offset order.

Two (then three) `llm-worker serve` processes on SmolLM2-135M-Instruct serve requests of mixed prompt and output
lengths, so within a partition short requests finish before long ones read earlier, and their finals are
committed above the partition's watermark. A read_committed reader (and, at the end, librdkafka's consumer, as a
third-party client would read) must see exactly one final per request id through:

- a SIGKILL: the killed worker's partitions move, and their new owner starts from committed offsets whose
  progress metadata lists answered requests above them, and resumes the streams that were under way (read back
  through our client's stitching: whole, no seq twice; greedy and seeded outputs equal an uninterrupted run);
- a frozen zombie (SIGSTOP past its session timeout, then SIGCONT): its partitions move while it holds running
  requests, and its late transactions are fenced;
- a worker joining while requests run: the partitions it takes were given up with answers above their
  watermark.

Each phase proves its fault hit what the bug needed: finals committed above a watermark on the partitions that
moved, read back from the group's committed offsets right after the kill and from the new owner's log
("answered already; skipped"), and requests still unanswered when the fault came.
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
                                                 third_party_final_counts, wait_for_answers_above_watermark,
                                                 wait_until_fenced)
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
    killed, frozen = (mixed_requests(p, 48) for p in ("kill", "freeze"))
    # Longer streams, most urgent, so some are under way when the kill comes: their next owner resumes them.
    long = long_requests("long", 4)
    killed = long + killed
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2", "w1b", "w3")}
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

            # A frozen zombie: w2 stopped while its commits record answers above its watermarks and it runs
            # requests; w1b takes every partition over and answers the rest; w2 resumes and is fenced.
            procs["w1b"] = await start(kafka, "w1b", tmp_path, smollm2_path)
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions, timeout_s=120)
            offsets = await produce_requests(kafka, frozen)
            w2_parts = owned_by(committed, "w2")
            await wait_for_answers_above_watermark(kafka, committed, w2_parts, frozen, offsets)
            procs["w2"].send_signal(signal.SIGSTOP)
            await wait_assigned(committed, {"w1b"}, kafka.num_request_partitions, timeout_s=60)
            await committed.wait_until(lambda r: all_answered(committed, frozen), 180, "finals while w2 is frozen")
            procs["w2"].send_signal(signal.SIGCONT)
            await wait_until_fenced(logs["w2"])
            check_exactly_one(committed, frozen, "SIGSTOP zombie")
            assert skipped_in_log(logs["w1b"]) >= 1, "w1b took w2's partitions over without skipping an answer"
            assert "fenced" in logs["w2"].read_text(errors="replace")
            await wait_assigned(committed, {"w1b", "w2"}, kafka.num_request_partitions, timeout_s=60)

            # A worker joins under steady traffic: requests keep coming while it loads its model and joins, so
            # the partitions it takes are given up with requests running and answers above their watermarks.
            procs["w3"] = await start(kafka, "w3", tmp_path, smollm2_path)
            joined = []
            while not owned_by(committed, "w3"):
                batch = mixed_requests(f"join{len(joined)}", 8)
                await produce_requests(kafka, batch)
                joined += batch
                await asyncio.sleep(2.0)
            await wait_assigned(committed, {"w1b", "w2", "w3"}, kafka.num_request_partitions, timeout_s=120)
            joined_unanswered = sum(1 for _, q in joined if not committed.results.finals.get(q.id))
            tail = mixed_requests("join-after", 12)
            await produce_requests(kafka, tail)
            joined += tail
            await committed.wait_until(lambda r: all_answered(committed, joined), 180, "finals after the join")
            check_exactly_one(committed, joined, "a worker joining", shed_ok=True)
        finally:
            await stop(list(procs.values()))
    assert joined_unanswered > 0, "the join came after every request was answered: it moved nothing in flight"
    assert skipped_in_log(logs["w3"]) >= 1, "w3 took partitions over without skipping an answer"
    everything = {q.id for _, q in killed + frozen + joined}
    counts = await asyncio.to_thread(third_party_final_counts, kafka, killed + frozen + joined)
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
