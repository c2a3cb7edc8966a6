"""n > 1 and best_of through a real broker, on the tiny random Llama: one chunk sequence and one final per
completion, then a request-level final; completions share the prompt's KV blocks; seeded completions are
what the engine gives each derived seed; best_of returns the completion of highest cumulative logprob."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.request import GenerationRequest, SamplingSpec
from worker.transport.requests.dispatcher import to_engine_requests
from worker.transport.requests.local_queue import QueuedRequest
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings
from tests.transport.test_stream_kafka import direct_texts, tiny_engine

pytestmark = pytest.mark.kafka

PROMPT = "Write a short poem about the sea and the wind, with rhymes. " * 3
SAMPLING = SamplingSpec(temperature=0.9, seed=7, ignore_eos=True, logprobs=True)


def completion_texts(engine, request: GenerationRequest) -> list[str]:
    """Each completion's text from the engine directly, with the seeds the dispatcher derives."""
    queued = QueuedRequest(request=request, partition=0, offset=0, priority=0, attempt=0,
                           timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="", num_prompt_tokens=1)
    engine_requests = to_engine_requests(queued)
    texts = direct_texts(engine, engine_requests)
    return [texts[r.request_id] for r in engine_requests]


async def test_n_completions_and_best_of_through_the_broker(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    several = GenerationRequest(id="several", prompt=PROMPT, max_new_tokens=12, n=3, sampling=SAMPLING)
    best = GenerationRequest(id="best", prompt=PROMPT, max_new_tokens=12, n=1, best_of=3, sampling=SAMPLING)
    greedy = GenerationRequest(id="greedy", prompt=PROMPT, max_new_tokens=6, n=2, stream=False)
    expected = completion_texts(tiny_engine(tiny_model_path), several)
    assert len(set(expected)) == 3  # derived seeds: three different samples
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), tiny_engine(tiny_model_path), max_num_seqs=16):
            await produce_requests(kafka, [(1, several), (1, best), (2, greedy)])
            await collector.wait_until(
                lambda r: all(any(f.index is None for f in r.finals.get(q.id, [])) for q in (several, best, greedy)),
                60, "request-level finals")
    results = collector.results

    finals = results.finals["several"]
    assert sorted(f.index for f in finals if f.index is not None) == [0, 1, 2] and finals[-1].index is None
    completions = {f.index: f for f in finals if f.index is not None}
    chunks = results.chunks[("several", finals[-1].attempt)]
    for index, final in completions.items():
        mine = [c for c in chunks if c.index == index]
        assert [c.seq for c in mine] == list(range(final.num_chunks))
        assert "".join(c.text for c in mine) == final.text == expected[index]
        assert final.status == "completed" and len(final.logprobs) == final.usage.completion_tokens == 12
    # The later completions took the prompt's full blocks from the prefix cache.
    assert completions[0].usage.cached_tokens == 0
    assert completions[1].usage.cached_tokens > 0 and completions[2].usage.cached_tokens > 0
    request_final = finals[-1]
    assert (request_final.status, request_final.finish_reason, request_final.text) == ("completed", "length", None)
    assert request_final.usage.completion_tokens == 36 and request_final.num_chunks == len(chunks)

    # best_of=3 samples the same three completions (same seeds) and returns the one of highest logprob sum.
    scores = {i: sum(lp.logprob for lp in f.logprobs) for i, f in completions.items()}
    best_finals = results.finals["best"]
    assert [f.index for f in best_finals] == [0, None]
    assert best_finals[0].text == completions[max(scores, key=scores.get)].text
    assert ("best", best_finals[0].attempt) not in results.chunks  # best_of > n streams nothing
    assert best_finals[1].usage.completion_tokens == 36

    greedy_finals = results.finals["greedy"]
    assert len(greedy_finals) == 3 and greedy_finals[0].text == greedy_finals[1].text  # greedy: the same twice
    assert results.dead_letters == []


async def test_a_cancel_ends_every_completion_and_the_request_cancelled(kafka_topics):
    from worker.engine.instant import InstantEngine
    from tests.transport.test_cancel_kafka import Recorder, produce_cancel

    kafka = kafka_topics
    request = GenerationRequest(id="many", prompt="Tell a long story.", max_new_tokens=300, n=3,
                                sampling=SamplingSpec(ignore_eos=True))
    recorder = Recorder(InstantEngine(max_num_seqs=8))
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(chunk_interval_ms=0), recorder, max_num_seqs=8):
            await produce_requests(kafka, [(1, request)])
            await collector.wait_until(lambda r: len({c.index for (rid, _), cs in r.chunks.items() if rid == "many"
                                                      for c in cs}) == 3, 30, "three completions streaming")
            await produce_cancel(kafka, "many", "enough")
            await collector.wait_until(lambda r: any(f.index is None for f in r.finals.get("many", [])), 15,
                                       "the request-level final")
            await asyncio.sleep(0.3)  # room for a stray record after it
    finals = collector.results.finals["many"]
    assert sorted(f.index for f in finals[:-1]) == [0, 1, 2] and finals[-1].index is None
    assert all(f.status == "cancelled" for f in finals)
    chunks = collector.results.chunks[("many", finals[-1].attempt)]
    for final in finals[:-1]:
        assert final.text == "".join(c.text for c in chunks if c.index == final.index)
        assert 0 < final.usage.completion_tokens < 300
    assert finals[-1].usage.completion_tokens == sum(f.usage.completion_tokens for f in finals[:-1])
    assert [len(a.request_ids) for a in recorder.aborts] == [3]  # one abort for the three, all at once
