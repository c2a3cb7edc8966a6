"""A model family beside Llama end to end: requests written by librdkafka (confluent-kafka) to the real broker, a
worker serving a Gemma 3 layout (windows alternating with global layers, scaled rope: the layout furthest from
Llama's, where the other families take the same path), and the finals read back: each request's greedy tokens are
transformers' `generate` of the same prompt, and its text is the tokenizer's decoding of them. Each family's
forward is checked against transformers in tests/model/test_families.py; this is the path a user takes to it
(the model folder named in the worker's settings, the chat template, the wire, the streamed chunks)."""

from __future__ import annotations

import pytest
import torch

from schemas.decode import encode
from schemas.request import ChatMessage, GenerationRequest, SamplingSpec
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.real_producers import produce_librdkafka, request_partition
from worker.model.tiny import build_tiny_family

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MAX_NEW_TOKENS = 12


def family_engine(path):
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings

    return LLMEngine(EngineSettings(model=str(path), device="cpu", dtype="float32", max_num_seqs=8,
                                    num_kv_blocks=256, max_num_batched_tokens=64))


@pytest.mark.parametrize("family", ["gemma3"])
async def test_a_family_serves_through_the_broker_as_transformers_generates(family, kafka_topics, smollm2_path,
                                                                           tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kafka = kafka_topics
    path = build_tiny_family(tmp_path / family, smollm2_path, family)
    # Prompts past the windows (8 to 24 tokens) and of several lengths, half as chat (the template renders them).
    requests = [GenerationRequest(id=f"{family}-{i}", prompt=f"Number {i} is followed by " * (1 + i % 4),
                                  max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingSpec(temperature=0.0,
                                                                                       ignore_eos=True),
                                  stream=i % 3 != 0)
                for i in range(6)]
    requests += [GenerationRequest(id=f"{family}-chat-{i}", messages=[ChatMessage(
        role="user", content=f"Say something about the colour {colour}, briefly.")], max_new_tokens=MAX_NEW_TOKENS,
        sampling=SamplingSpec(temperature=0.0, ignore_eos=True)) for i, colour in enumerate(("red", "teal"))]
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), family_engine(path), max_num_seqs=8):
            produce_librdkafka(kafka, "zstd", [(request_partition(kafka, 1, r.id), r.id.encode(), encode(r), None)
                                               for r in requests])
            await collector.wait_until(lambda r: all(q.id in r.finals for q in requests), 120, "every final")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for request in requests:
        final = collector.results.latest_final(request.id)
        assert (final.status, final.reason) == ("completed", "length"), final
        if request.messages:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in request.messages],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(request.prompt)["input_ids"]
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                      min_new_tokens=MAX_NEW_TOKENS)[0, len(ids):].tolist()
        tokens, text = collector.results.delivered(final, request.stream)
        assert tokens == expected, request.id
        assert text == tokenizer.decode(expected, skip_special_tokens=True), request.id
        assert final.usage.prompt_tokens == len(ids)
