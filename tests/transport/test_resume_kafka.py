"""Streams that resume where they stopped: a worker SIGKILLed while its requests stream, and the worker that takes
its partitions over continues each from the progress the first one committed and the chunks it had delivered
since, instead of starting over.

Two `llm-worker serve` processes on the tiny model (long outputs, so requests are mid-stream when the kill
comes) behind a read_committed reader. Every request is read back through our client's stitching: one whole
stream per request, no gap, no seq written twice, nothing the reader must take back, the text and tokens of its
final; the kill must have hit streams under way (resumed requests counted from the records, not the worker's
word); each resumed output equals an uninterrupted run of the same request, token for token, for greedy,
seeded sampling and n = 2; and a cancel sent while the partition moves wins, with the text already delivered.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import pytest

from schemas.priority import partition_for
from schemas.request import GenerationRequest, SamplingSpec
from tests.transport.exactly_once_checks import all_answered, owned_by, stop
from tests.transport.kafka_helpers import Collector, produce_requests, start_worker_process
from tests.transport.resume_checks import stitch
from tests.transport.test_cancel_kafka import produce_cancel
from tests.transport.test_failover_kafka import wait_assigned

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ENGINE_ENV = {"ENGINE_DEVICE": "cpu", "ENGINE_MAX_NUM_SEQS": "4", "ENGINE_MAX_NUM_BATCHED_TOKENS": "256"}


def long_requests(prefix: str, n: int, max_new_tokens: int) -> list[tuple[int, GenerationRequest]]:
    out = []
    for i in range(n):
        kind = i % 4
        sampling = SamplingSpec(ignore_eos=True) if kind in (0, 2) else SamplingSpec(
            ignore_eos=True, temperature=0.8, top_p=0.95, seed=1000 + i)
        out.append((i % 3, GenerationRequest(
            id=f"{prefix}-{i}", prompt=f"{prefix} {i}: a story about streams that go on where they stopped",
            max_new_tokens=max_new_tokens, sampling=sampling, n=2 if kind == 3 else 1)))
    return out


def mid_stream_on(collector: Collector, kafka, requests, partitions: set[int], min_chunks: int) -> int:
    """Requests of these partitions that have streamed at least `min_chunks` chunks and have no final yet."""
    count = 0
    for priority, q in requests:
        partition = partition_for(priority, q.routing_key, kafka.num_request_partitions, kafka.num_priorities)
        if partition in partitions and not collector.results.finals.get(q.id):
            if len(collector.results.chunks.get((q.id, min(
                    [a for (i, a) in collector.results.chunks if i == q.id], default=-1)), [])) >= min_chunks:
                count += 1
    return count


async def test_a_killed_workers_streams_resume_on_the_next_owner(kafka_topics, tmp_path: Path, tiny_model_path,
                                                                  monkeypatch):
    kafka = kafka_topics
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    requests = long_requests("resume", 16, 400)
    async with Collector(kafka, isolation_level="read_committed") as committed:
        procs = {name: await start_worker_process(kafka, ["--model", str(tiny_model_path), "--worker-id", name],
                                                  tmp_path / f"{name}.log", drain_timeout_s=0.3,
                                                  chunk_interval_ms=30)
                 for name in ("w1", "w2")}
        try:
            await wait_assigned(committed, {"w1", "w2"}, kafka.num_request_partitions, timeout_s=60)
            await produce_requests(kafka, requests)
            w1_parts = owned_by(committed, "w1")
            await committed.wait_until(lambda r: mid_stream_on(committed, kafka, requests, w1_parts, 5) >= 2, 60,
                                       "w1 streaming requests")
            await asyncio.sleep(1.0)  # a round of progress is committed
            under_way = mid_stream_on(committed, kafka, requests, w1_parts, 1)
            procs["w1"].send_signal(signal.SIGKILL)
            await procs["w1"].wait()
            # A cancel during the takeover wins: the request ends cancelled with what it had delivered.
            cancelled = next(q.id for p, q in requests if q.n == 1 and not committed.results.finals.get(q.id)
                             and partition_for(p, q.routing_key, kafka.num_request_partitions,
                                               kafka.num_priorities) in w1_parts
                             and mid_stream_on(committed, kafka, [(p, q)], w1_parts, 5))
            await produce_cancel(kafka, cancelled, "taken over")
            await committed.wait_until(lambda r: all_answered(committed, requests), 180, "finals after the kill")
            check_exactly_one_resumed(committed, requests, cancelled)
            # The same requests under new ids, served from start to end by the survivor: the reference, for those
            # of the partitions that moved (the others ran from start to end on the survivor already).
            moved = [(p, q) for p, q in requests if q.id != cancelled and partition_for(
                p, q.routing_key, kafka.num_request_partitions, kafka.num_priorities) in w1_parts]
            reference = [(p, msgspec.structs.replace(q, id=f"{q.id}-ref")) for p, q in moved]
            await produce_requests(kafka, reference)
            await committed.wait_until(lambda r: all_answered(committed, reference), 180, "the reference finals")
        finally:
            await stop(list(procs.values()))
    (final,) = committed.results.finals[cancelled]
    delivered = [c for chunks in committed.results.chunks.values() for c in chunks if c.id == cancelled]
    assert final.status == "cancelled" and final.resumed_at is not None, final
    assert final.text == "".join(c.text for c in sorted(delivered, key=lambda c: c.seq)) != "", final
    assert final.num_chunks == len(delivered) and final.usage.completion_tokens == len(final.token_ids), final
    found = await stitch(committed, [q.id for _, q in requests if q.id != cancelled])
    print(f"under way at the kill: {under_way}; resumed {found.resumed}, restarted {found.restarted}, "
          f"repeated seqs {found.repeated_seqs}, tokens kept {found.tokens_kept}")
    assert not found.problems, found.problems
    assert under_way >= 2 and found.resumed >= 2, (under_way, found)
    assert found.repeated_seqs == 0, found
    assert "unfinished requests read back" in (tmp_path / "w2.log").read_text(errors="replace")
    assert len(moved) >= 2
    for _, q in moved:
        got = {f.index: f.token_ids for f in committed.results.finals[q.id]}
        want = {f.index: f.token_ids for f in committed.results.finals[f"{q.id}-ref"]}
        assert got == want, q.id


def check_exactly_one_resumed(collector: Collector, requests, cancelled: str) -> None:
    """One final per request (and per completion), each completed but the one cancelled: the stream itself is
    checked by stitch()."""
    for _, q in requests:
        finals = collector.results.finals[q.id]
        indexes = [f.index for f in finals]
        assert len(indexes) == len(set(indexes)) and None in indexes, (q.id, [(f.index, f.attempt) for f in finals])
        assert all(f.status == ("cancelled" if q.id == cancelled else "completed") for f in finals), (q.id, finals)


async def test_without_a_progress_topic_the_worker_serves_and_says_streams_will_start_over(kafka_settings, caplog):
    """A deployment that has not created the progress topic: a record for it would abort every transaction of
    its lane, so the worker writes none, says so in one line, and answers every request exactly once."""
    from worker.broker.topics import ensure_topics
    from worker.engine.instant import InstantEngine
    from tests.transport.kafka_helpers import running_worker, worker_settings

    await ensure_topics(kafka_settings.model_copy(update={"progress_topic": ""}))
    kafka = kafka_settings  # names a progress topic that does not exist
    requests = [(i % 3, GenerationRequest(id=f"np-{i}", prompt="p", max_new_tokens=6)) for i in range(12)]
    async with Collector(kafka, isolation_level="read_committed") as committed:
        async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=4, step_time_s=0.01)):
            await produce_requests(kafka, requests)
            await committed.wait_until(lambda r: all_answered(committed, requests), 30, "every final")
            await asyncio.sleep(0.5)
    for _, q in requests:
        (final,) = committed.results.finals[q.id]
        assert final.status == "completed" and final.text == "".join(
            c.text for c in committed.results.chunks[(q.id, final.attempt)]), final
    warned = [r.getMessage() for r in caplog.records if "progress topic" in r.getMessage()]
    assert len(warned) == 1 and "is missing" in warned[0] and "start over" in warned[0], warned
