"""Speculative decoding as a user meets it: requests written by librdkafka to the real broker, a worker whose engine
drafts (ENGINE_SPECULATIVE_NGRAM_TOKENS) on the default model, and the chunks and finals read back. A step that
keeps drafts hands the transport several tokens at once; the streams must still be whole and in order, and every
request's tokens, text and finish reason those of the same engine without drafts."""

from __future__ import annotations

import pytest

from schemas.decode import encode
from schemas.request import ChatMessage, GenerationRequest, SamplingSpec
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.real_producers import produce_librdkafka, request_partition
from worker.engine.api import EngineRequest, SamplingParams

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TEXT = ("Apache Kafka stores records in partitions. Each partition is an ordered log, and a consumer group divides "
        "the partitions of a topic among its members. ")


def engine(path, num_draft: int):
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings

    return LLMEngine(EngineSettings(model=str(path), device="cpu", dtype="float32", max_num_seqs=4,
                                    num_kv_blocks=128, max_num_batched_tokens=256,
                                    speculative_ngram_tokens=num_draft))


def wire_requests() -> list[GenerationRequest]:
    def copy(request_id: str, **sampling) -> GenerationRequest:
        return GenerationRequest(id=request_id, messages=[ChatMessage(role="user", content=(
            "Repeat this text exactly:\n" + TEXT))], max_new_tokens=40, sampling=SamplingSpec(**sampling),
            stream=not request_id.endswith("whole"))

    return [copy("greedy"), copy("greedy-whole"), copy("seeded", temperature=0.9, seed=11),
            copy("stopped", stop=["members"])]


async def test_drafted_streams_are_whole_and_equal_plain_decoding(kafka_topics, smollm2_path):
    kafka = kafka_topics
    requests = wire_requests()
    drafting = engine(smollm2_path, 4)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), drafting, max_num_seqs=4):
            produce_librdkafka(kafka, "lz4", [(request_partition(kafka, 1, r.id), r.id.encode(), encode(r), None)
                                              for r in requests])
            await collector.wait_until(lambda r: all(q.id in r.finals for q in requests), 120, "every final")
    assert drafting.num_accepted_tokens >= 0.5 * drafting.num_proposed_tokens > 0
    plain = engine(smollm2_path, 0).generate([EngineRequest(
        r.id, messages=[{"role": m.role, "content": m.content} for m in r.messages],
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.sampling.temperature,
                                seed=r.sampling.seed, stop=tuple(r.sampling.stop))) for r in requests])
    for request in requests:
        final = collector.results.latest_final(request.id)
        expected = plain[request.id]
        assert (final.status, final.reason) == ("completed", expected.finish_reason), request.id
        tokens, text = collector.results.delivered(final, request.stream)
        assert tokens == expected.token_ids, request.id
        assert text == expected.text, request.id
        assert final.usage.completion_tokens == len(expected.token_ids)
    assert collector.results.latest_final("stopped").reason == "stop"
    # Operators see the drafts on the status topic.
    last = [s for s in collector.results.statuses if s.num_draft_tokens][-1]
    assert 0 < last.num_accepted_draft_tokens <= last.num_draft_tokens <= drafting.num_proposed_tokens
