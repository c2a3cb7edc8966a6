"""The engine core in its own process (worker/transport/requests/engine_process.py): EngineThread's interface across a
pipe, a child that cannot build its engine reported at spawn, and the whole worker on Kafka with
WORKER_ENGINE_PROCESS (the same streamed texts as the engine run directly, a clean stop)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from schemas.request import GenerationRequest, SamplingSpec
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings
from tests.transport.test_stream_kafka import as_engine_request, direct_texts, tiny_engine
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.allocator_settings import AllocatorSettings
from worker.serve import build_engine, build_engine_process
from worker.transport.requests.engine_process import EngineProcess

pytestmark = pytest.mark.slow  # starts engine processes: in the full suite, not the fast subset


def spawn_instant() -> EngineProcess:
    return EngineProcess.spawn(functools.partial(build_engine, "instant", EngineSettings(max_num_seqs=8), 1.0))


async def test_requests_added_through_the_pipe_finish_and_stats_come_back():
    engine = spawn_instant()
    outputs: asyncio.Queue = asyncio.Queue()
    engine.attach(asyncio.get_running_loop(), outputs).start()
    try:
        assert engine.alive and engine.stats.num_running == 0
        for i in range(20):
            engine.add(EngineRequest(f"p{i}", prompt="hello there", sampling=SamplingParams(max_new_tokens=3)))
        engine.abort(["p19"])
        finals, tokens = {}, {f"p{i}": 0 for i in range(20)}
        while len(finals) < 20:
            for out in await asyncio.wait_for(outputs.get(), 10):
                tokens[out.request_id] += len(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out.finish_reason
        assert finals.pop("p19") == "abort" and set(finals.values()) == {"length"}
        assert all(tokens[f"p{i}"] == 3 for i in range(19))
        await asyncio.sleep(0.1)
        assert engine.stats.num_steps > 0  # the child's counters reached the parent
    finally:
        await asyncio.to_thread(engine.stop)
    assert not engine.alive


@pytest.mark.slow  # ~4 s: the child imports torch before it finds no model
def test_a_child_that_cannot_build_its_engine_fails_the_spawn_with_its_reason(tmp_path):
    build = functools.partial(build_engine, "llm", EngineSettings(model=str(tmp_path / "no-such-model"),
                                                                   device="cpu"), 0.0)
    with pytest.raises(RuntimeError, match="failed to build its engine"):
        EngineProcess.spawn(build)


@pytest.mark.kafka
async def test_the_worker_streams_from_an_engine_in_its_own_process(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    requests = [(i % 3, GenerationRequest(id=f"ep-{i}", prompt=f"Count to {i}." * (1 + i % 2),
                                          max_new_tokens=2 + i % 4, sampling=SamplingSpec(ignore_eos=True)))
                for i in range(40)]
    expected = direct_texts(tiny_engine(tiny_model_path), [as_engine_request(r) for _, r in requests])
    settings = EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32", max_num_seqs=16,
                              num_kv_blocks=512, max_num_batched_tokens=256)
    transport = worker_settings(engine_process=True)
    # As serve() builds it: the child sets up its allocator and trims its heap (tests/test_memory.py).
    build = functools.partial(build_engine_process, AllocatorSettings(), "llm", settings, 0.0)
    engine = await asyncio.to_thread(EngineProcess.spawn, build)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, transport, engine, max_num_seqs=16):
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 45)
        results = collector.results
    for _, request in requests:
        [final] = results.finals[request.id]
        assert final.status == "completed" and final.text == expected[request.id]
        assert results.stream_text(request.id, final.attempt) == expected[request.id]
    assert not engine.alive  # the worker's stop stopped the child too
