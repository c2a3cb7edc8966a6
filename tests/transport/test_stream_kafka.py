"""200 requests over three priorities through a real broker: contiguous chunks, one completed final each,
text equal to the engine's own output for the same request."""

from __future__ import annotations

import time

import pytest

from schemas.request import GenerationRequest, SamplingSpec
from worker.engine.api import EngineRequest
from worker.engine.instant import InstantEngine
from worker.transport.requests.dispatcher import to_engine_requests
from worker.transport.requests.local_queue import QueuedRequest
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka


def direct_texts(engine, requests: list[EngineRequest]) -> dict[str, str]:
    """Run requests through an engine directly (no Kafka): the expectation for the streamed text."""
    texts = {r.request_id: "" for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
    return texts


def as_engine_request(request: GenerationRequest) -> EngineRequest:
    queued = QueuedRequest(request=request, partition=0, offset=0, priority=0, attempt=0,
                           timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="", num_prompt_tokens=1)
    [engine_req] = to_engine_requests(queued)
    engine_req.request_id = request.id
    return engine_req


def tiny_engine(model_path):
    from worker.model.settings import EngineSettings
    from worker.engine.engine import LLMEngine

    return LLMEngine(EngineSettings(model=str(model_path), device="cpu", dtype="float32", max_num_seqs=16,
                                    num_kv_blocks=512, max_num_batched_tokens=256))


@pytest.fixture(params=["instant", "tiny-llama"])
def make_engine(request):
    """A factory of identical engines: the instant engine, and the real LLMEngine on the tiny random Llama."""
    if request.param == "instant":
        return lambda: InstantEngine(max_num_seqs=16)
    model_path = request.getfixturevalue("tiny_model_path")
    return lambda: tiny_engine(model_path)


async def test_two_hundred_requests_stream_completely(kafka_topics, make_engine):
    kafka = kafka_topics
    requests = [
        (i % 3, GenerationRequest(id=f"req-{i}", prompt=f"Tell me about number {i}." * (1 + i % 3),
                                  max_new_tokens=2 + i % 5, sampling=SamplingSpec(ignore_eos=True),
                                  metadata={"n": str(i)} if i % 4 == 0 else None))
        for i in range(200)
    ]
    expected = direct_texts(make_engine(), [as_engine_request(r) for _, r in requests])
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), make_engine(), max_num_seqs=16):
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 45)
        results = collector.results
        for _, request in requests:
            finals = results.finals[request.id]
            assert len(finals) == 1, finals
            final = finals[0]
            assert final.status == "completed" and final.reason == "length"
            chunks = results.chunks[(request.id, final.attempt)]
            assert [c.seq for c in chunks] == list(range(final.num_chunks))
            assert final.num_chunks >= 1
            assert results.stream_text(request.id, final.attempt) == expected[request.id] == final.text
            assert final.usage.completion_tokens == request.max_new_tokens  # ignore_eos: always the full length
            assert final.timings.e2e_ms is not None and final.timings.ttft_ms is not None
            assert final.metadata == request.metadata
        assert results.dead_letters == [] and results.undecodable == 0
        assert any(s.assigned_partitions == list(range(kafka.num_request_partitions)) for s in results.statuses)
