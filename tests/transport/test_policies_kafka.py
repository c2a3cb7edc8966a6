"""Every batching policy served through the Kafka worker, on the real LLMEngine (tiny random Llama): a
static batch that cannot fill starts once the consumer has caught up, a dynamic batch when its window
closes, and the engine thread sleeps instead of polling while a batch forms."""

from __future__ import annotations

import time

import pytest

from schemas.request import GenerationRequest, SamplingSpec
from worker.model.settings import EngineSettings
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka


def counting_engine(model_path, policy: str):
    """An LLMEngine that counts step() calls, to tell steps that ran from calls that found nothing to run."""
    from worker.engine.engine import LLMEngine

    class CountingEngine(LLMEngine):
        num_step_calls = 0

        def step(self):
            self.num_step_calls += 1
            return super().step()

    return CountingEngine(EngineSettings(
        model=str(model_path), device="cpu", dtype="float32", max_num_seqs=16, num_kv_blocks=256,
        max_num_batched_tokens=256, policy=policy, max_batch_size=16, batch_window_ms=400))


@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
async def test_a_partial_batch_is_served_under_every_policy_without_polling(kafka_topics, tiny_model_path, policy):
    kafka = kafka_topics
    requests = [(i % 3, GenerationRequest(id=f"{policy}-{i}", prompt=f"number {i}", max_new_tokens=4,
                                          sampling=SamplingSpec(ignore_eos=True))) for i in range(3)]
    engine = counting_engine(tiny_model_path, policy)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), engine, max_num_seqs=16):
            sent = time.monotonic()
            await produce_requests(kafka, requests)
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 30)
            took_s = time.monotonic() - sent
        for _, request in requests:
            (final,) = collector.results.finals[request.id]
            assert final.status == "completed" and final.usage.completion_tokens == 4
    # 3 requests never fill a batch of 16: dynamic waits for its 400 ms window, static for the end of input.
    if policy == "dynamic":
        assert took_s >= 0.4
    assert engine.num_steps >= 4
    idle_calls = engine.num_step_calls - engine.num_steps
    assert idle_calls <= 5, f"{idle_calls} step() calls found nothing to run: the engine thread polled"
