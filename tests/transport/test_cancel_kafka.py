"""Cancellation through a real broker: a cancel record on the control topic stops its request within one engine
step wherever it is (running, waiting in the engine, in the local queue), frees its KV blocks, and ends it with
one `cancelled` final holding the text streamed so far; a cancel that comes before its request, or before a
restart redelivers it, still counts; a cancel of an unknown or finished id changes nothing."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
from aiokafka import AIOKafkaProducer

from schemas.request import GenerationRequest, SamplingSpec
from worker.kafka_settings import KafkaSettings
from worker.engine.api import EngineStats
from worker.engine.instant import InstantEngine, expected_text
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings
from tests.transport.test_stream_kafka import as_engine_request, direct_texts, tiny_engine

pytestmark = pytest.mark.kafka

STEP_S = 0.05


@dataclass
class AbortSeen:
    request_ids: list[str]
    num_steps: int
    """Steps the engine had finished when the abort ran."""
    before: EngineStats
    after: EngineStats


class Recorder:
    """An engine with slow steps that records what it was asked: the ids added, and for each abort the step
    count and the stats just before and after it (what the KV check reads)."""

    def __init__(self, engine, step_delay_s: float = STEP_S) -> None:
        self.engine = engine
        self.step_delay_s = step_delay_s
        self.num_steps = 0
        self.added: list[str] = []
        self.aborts: list[AbortSeen] = []

    def add_request(self, request):
        self.added.append(request.request_id)
        return self.engine.add_request(request)

    def step(self):
        time.sleep(self.step_delay_s)
        outputs = self.engine.step()
        self.num_steps += 1
        return outputs

    def abort(self, request_ids):
        before = self.engine.stats()
        outputs = self.engine.abort(request_ids)
        self.aborts.append(AbortSeen(list(request_ids), self.num_steps, before, self.engine.stats()))
        return outputs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def watch_aborts(worker, recorder: Recorder) -> list[tuple[list[str], int]]:
    """(engine ids, engine steps done) each time the worker asks the engine thread for an abort."""
    asked: list[tuple[list[str], int]] = []
    original = worker.engine_thread.abort

    def abort(request_ids):
        if request_ids:
            asked.append((list(request_ids), recorder.num_steps))
        original(request_ids)

    worker.engine_thread.abort = abort
    return asked


async def produce_cancel(kafka: KafkaSettings, request_id: str, reason: str = "") -> None:
    """As any Kafka client would: a JSON value, key = request id, default partitioner."""
    producer = AIOKafkaProducer(**kafka.client_kwargs())
    await producer.start()
    try:
        value = f'{{"kind":"cancel","id":"{request_id}","reason":"{reason}"}}'.encode()
        await producer.send_and_wait(kafka.control_topic, value, key=request_id.encode())
    finally:
        await producer.stop()


def long_request(request_id: str, max_new_tokens: int = 200, prompt: str = "Tell a long story.") -> GenerationRequest:
    return GenerationRequest(id=request_id, prompt=prompt, max_new_tokens=max_new_tokens,
                             sampling=SamplingSpec(ignore_eos=True))


def check_cancelled_stream(results, request_id: str, full_text: str | None = None):
    """One `cancelled` final whose text is what the chunks carried, a prefix of the whole answer, with matching
    usage; no chunk after it."""
    [final] = results.finals[request_id]
    assert (final.status, final.reason, final.finish_reason) == ("cancelled", "cancelled", None), final
    chunks = results.stream_of(final)  # a resumed attempt's, with the chunks below resumed_at
    assert [c.seq for c in chunks] == list(range(final.num_chunks))
    assert final.text == "".join(c.text for c in chunks)
    assert final.token_ids == [t for c in chunks for t in c.token_ids]
    assert final.usage.completion_tokens == len(final.token_ids)
    if full_text is not None:
        assert full_text.startswith(final.text) and len(final.text) < len(full_text)
    return final


@pytest.fixture(params=["instant", "tiny-llama"])
def engine_kind(request):
    if request.param == "instant":
        return "instant", lambda: InstantEngine(max_num_seqs=8)
    model_path = request.getfixturevalue("tiny_model_path")
    return "tiny-llama", lambda: tiny_engine(model_path)


async def test_a_running_request_stops_within_one_step_frees_its_blocks_and_ends_cancelled(kafka_topics, engine_kind):
    kafka = kafka_topics
    kind, make_engine = engine_kind
    victim, bystander = long_request("victim"), long_request("bystander", 30, prompt="Something else.")
    full_text = direct_texts(make_engine(), [as_engine_request(victim)])[victim.id]
    recorder = Recorder(make_engine())
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(chunk_interval_ms=0), recorder, max_num_seqs=8) as worker:
            asked = watch_aborts(worker, recorder)
            await produce_requests(kafka, [(1, victim), (1, bystander)])
            await collector.wait_until(lambda r: sum(len(c) for (rid, _), c in r.chunks.items() if rid == "victim")
                                       >= 5, 30, "victim streaming")
            sent = time.monotonic()
            await produce_cancel(kafka, "victim", "the user left")
            await collector.wait_until(lambda r: "victim" in r.finals, 15, "the cancelled final")
            latency_ms = (time.monotonic() - sent) * 1000
            await collector.wait_until(lambda r: "bystander" in r.finals, 30, "the bystander's final")
            await asyncio.sleep(0.5)  # room for any stray chunk after the final
            # The worker serves on.
            await produce_requests(kafka, [(0, long_request("after", 3))])
            await collector.wait_until(lambda r: "after" in r.finals, 15, "a request after the cancel")
        results = collector.results
        final = check_cancelled_stream(results, "victim", full_text)
        assert final.num_chunks >= 5 and "the user left" in final.message and final.usage.prompt_tokens > 0
        assert results.finals["bystander"][0].status == "completed"
        assert results.finals["after"][0].status == "completed"
        assert len(results.finals["victim"]) == 1
    # Within one step of the worker reading the cancel, the engine aborted it and its blocks were free.
    [(ids, steps_when_asked)] = asked
    [seen] = recorder.aborts
    assert seen.request_ids == ids and ids[0].startswith("victim#")
    assert seen.num_steps - steps_when_asked <= 1, (steps_when_asked, seen.num_steps)
    assert seen.after.num_running == seen.before.num_running - 1
    assert seen.after.kv_usage < seen.before.kv_usage
    if kind == "tiny-llama":
        pool = recorder.engine.scheduler.pool
        assert recorder.engine.scheduler.kv_usage == 0.0 and pool.num_free_blocks == pool.num_blocks
    print(f"\nCANCEL-LATENCY {kind}: cancel produced -> cancelled final read {latency_ms:.0f} ms "
          f"(step {STEP_S * 1000:.0f} ms, {final.usage.completion_tokens} tokens streamed)")


async def test_requests_waiting_in_the_engine_or_the_local_queue_end_cancelled_without_output(kafka_topics):
    kafka = kafka_topics
    recorder = Recorder(InstantEngine(max_num_seqs=1))
    # One seat in the engine, two places in it: A runs, B waits in the engine, C in the local queue.
    settings = worker_settings(chunk_interval_ms=0, max_engine_inflight=2)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, settings, recorder, max_num_seqs=1) as worker:
            await produce_requests(kafka, [(1, long_request("A", 400))])
            await collector.wait_until(lambda r: any(rid == "A" for rid, _ in r.chunks), 30, "A runs")
            await produce_requests(kafka, [(1, long_request("B", 5))])
            async with asyncio.timeout(10):
                while recorder.stats().num_waiting < 1:
                    await asyncio.sleep(0.02)
            await produce_requests(kafka, [(1, long_request("C", 5))])
            async with asyncio.timeout(10):
                while len(worker.queue) < 1:
                    await asyncio.sleep(0.02)
            await produce_cancel(kafka, "C")
            await collector.wait_until(lambda r: "C" in r.finals, 10, "C cancelled")
            assert "B" not in collector.results.finals and len(worker.queue) == 0
            await produce_cancel(kafka, "B")
            await collector.wait_until(lambda r: "B" in r.finals, 10, "B cancelled")
            assert recorder.stats().num_waiting == 0
            await produce_cancel(kafka, "A")
            await collector.wait_until(lambda r: "A" in r.finals, 10, "A cancelled")
        results = collector.results
        for rid, where in (("B", "after 0 output tokens"), ("C", "while it waited in the local queue")):
            final = check_cancelled_stream(results, rid)
            assert (final.text, final.token_ids, final.num_chunks) == ("", [], 0), final
            assert where in final.message, final.message
        check_cancelled_stream(results, "A", expected_text(as_engine_request(long_request("A", 400))))
    assert not any(rid.startswith("C#") for rid in recorder.added)  # C never reached the engine
    assert [s.request_ids[0].split("#")[0] for s in recorder.aborts] == ["B", "A"]


async def test_a_cancel_that_arrives_before_its_request_still_cancels_it(kafka_topics):
    kafka = kafka_topics
    recorder = Recorder(InstantEngine(max_num_seqs=8))
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), recorder, max_num_seqs=8) as worker:
            await produce_cancel(kafka, "early", "changed my mind")
            async with asyncio.timeout(10):
                while worker.cancels.get("early", time.time() * 1000) is None:
                    await asyncio.sleep(0.02)
            await produce_requests(kafka, [(0, long_request("early", 50)), (0, long_request("normal", 3))])
            await collector.wait_until(lambda r: {"early", "normal"} <= r.finals.keys(), 15, "both finals")
        results = collector.results
        final = check_cancelled_stream(results, "early")
        assert (final.text, final.num_chunks, final.usage.completion_tokens) == ("", 0, 0)
        assert "before it ran" in final.message and "changed my mind" in final.message
        assert results.finals["normal"][0].status == "completed"
    assert not any(rid.startswith("early#") for rid in recorder.added)


async def test_a_cancel_of_an_unknown_or_finished_id_changes_nothing(kafka_topics):
    kafka = kafka_topics
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=8), max_num_seqs=8) as worker:
            await produce_requests(kafka, [(1, long_request("done", 4))])
            await collector.wait_until(lambda r: "done" in r.finals, 15, "done's final")
            await produce_cancel(kafka, "done")
            await produce_cancel(kafka, "never-sent")
            async with asyncio.timeout(10):
                while len(worker.cancels) < 2:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)
            await produce_requests(kafka, [(1, long_request("next", 4))])
            await collector.wait_until(lambda r: "next" in r.finals, 15, "next's final")
            assert worker.control.num_undecodable == 0
        results = collector.results
        assert [f.status for f in results.finals["done"]] == ["completed"]
        assert "never-sent" not in results.finals and not any(rid == "never-sent" for rid, _ in results.chunks)
        assert results.finals["next"][0].status == "completed"
        assert results.dead_letters == [] and results.undecodable == 0


async def test_a_cancelled_request_redelivered_after_a_restart_stays_cancelled(kafka_topics):
    kafka = kafka_topics
    request = long_request("redelivered", 400)
    async with Collector(kafka) as collector:
        # The first worker dies mid-request (drain timeout 0): the request stays uncommitted.
        first = Recorder(InstantEngine(max_num_seqs=8))
        async with running_worker(kafka, worker_settings(drain_timeout_s=0.0, chunk_interval_ms=0), first,
                                  max_num_seqs=8):
            await produce_requests(kafka, [(1, request)])
            await collector.wait_until(lambda r: any(rid == "redelivered" for rid, _ in r.chunks), 30, "it streams")
        [(_, first_attempt)] = [key for key in collector.results.chunks if key[0] == "redelivered"]
        assert "redelivered" not in collector.results.finals
        # Cancelled while no worker runs; the next worker learns of it only from its look-back read.
        await produce_cancel(kafka, "redelivered")
        second = Recorder(InstantEngine(max_num_seqs=8))
        async with running_worker(kafka, worker_settings(), second, max_num_seqs=8):
            await collector.wait_until(lambda r: "redelivered" in r.finals, 30, "the redelivery's final")
        [final] = collector.results.finals["redelivered"]
        assert final.status == "cancelled" and final.attempt > first_attempt
        # It never ran again, and it ends with what the first worker had delivered: its stream resumed there
        # (the first worker's progress went out with its last transaction), or nothing if none was recorded.
        delivered = collector.results.chunks[("redelivered", first_attempt)]
        kept = delivered[:final.resumed_at or 0]
        assert (final.text, final.num_chunks) == ("".join(c.text for c in kept), len(kept))
        assert final.resumed_at is None or final.resumed_at > 0, final
        assert "before it ran" in final.message
    assert not any(rid.startswith("redelivered#") for rid in second.added)


async def test_a_missing_control_topic_holds_nothing_up_and_is_read_once_created(kafka_settings, monkeypatch):
    from worker.broker.topics import ensure_topics
    from worker.transport.requests import control

    monkeypatch.setattr(control, "MISSING_TOPIC_RETRY_S", 0.5)
    kafka = kafka_settings
    without_control = kafka.model_copy(update={"control_topic": kafka.control_topic + ".later"})
    await ensure_topics(without_control)  # every topic but the one the worker reads cancels from
    recorder = Recorder(InstantEngine(max_num_seqs=8))
    settings = worker_settings(chunk_interval_ms=0, cancel_sync_timeout_s=30.0)
    async with Collector(kafka) as collector:
        started = time.monotonic()
        async with running_worker(kafka, settings, recorder, max_num_seqs=8):
            await produce_requests(kafka, [(0, long_request("served", 3))])
            await collector.wait_until(lambda r: "served" in r.finals, 15, "a request served without cancels")
            # Not the 30 s intake would wait for a control topic that exists but cannot be read up to date.
            assert time.monotonic() - started < 15
            await ensure_topics(kafka)  # the control topic appears: the reader finds it at its next look
            await produce_requests(kafka, [(0, long_request("late", 400))])
            await collector.wait_until(lambda r: any(rid == "late" for rid, _ in r.chunks), 15, "late streams")
            await asyncio.sleep(1.5)
            await produce_cancel(kafka, "late")
            await collector.wait_until(lambda r: "late" in r.finals, 15, "late cancelled")
        assert collector.results.finals["served"][0].status == "completed"
        check_cancelled_stream(collector.results, "late")
