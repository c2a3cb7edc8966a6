"""Requests naming different LoRA adapters, and the base, through a real broker and a worker on the tiny model:
each final holds the tokens transformers + PEFT generate for its adapter; an unknown adapter ends in an
invalid_request final naming it; the status topic lists the adapters and the loaded ones."""

from __future__ import annotations

import pytest
import torch

from schemas.request import GenerationRequest, SamplingSpec
from tests.model.lora_adapters import ATTENTION, greedy, make_adapter, reference_model
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MAX_NEW = 6


async def test_requests_for_different_adapters_get_their_adapters_tokens(kafka_topics, tiny_model_path, tmp_path):
    from worker.model.settings import EngineSettings
    from worker.engine.engine import LLMEngine

    make_adapter(tiny_model_path, tmp_path / "alpha", seed=11, rank=8)
    make_adapter(tiny_model_path, tmp_path / "beta", seed=12, rank=16, targets=ATTENTION)
    prompts = [torch.randint(3, 49152, (7 + i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(3)]
    models = [None, "alpha", "beta"]
    expected = {}
    for model in models:
        ref = reference_model(tiny_model_path, None if model is None else tmp_path / model)
        for i, prompt in enumerate(prompts):
            expected[f"{model or 'base'}-{i}"] = greedy(ref, prompt, MAX_NEW)[0]
    assert len({tuple(expected[f"{m or 'base'}-0"]) for m in models}) == 3, "the adapters were meant to differ"

    requests = [(0, GenerationRequest(id=f"{model or 'base'}-{i}", prompt_token_ids=prompt, model=model,
                                      max_new_tokens=MAX_NEW, stream=False, sampling=SamplingSpec(ignore_eos=True)))
                for model in models for i, prompt in enumerate(prompts)]
    # The base model's folder name is a name for the base too.
    requests.append((1, GenerationRequest(id="named-base", prompt_token_ids=prompts[0], model=tiny_model_path.name,
                                          max_new_tokens=MAX_NEW, stream=False,
                                          sampling=SamplingSpec(ignore_eos=True))))
    requests.append((1, GenerationRequest(id="unknown", prompt_token_ids=prompts[0], model="no-such-adapter",
                                          max_new_tokens=MAX_NEW)))
    engine = LLMEngine(EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32", max_num_seqs=16,
                                      num_kv_blocks=256, max_num_batched_tokens=256, adapters_dir=str(tmp_path)))
    async with Collector(kafka_topics) as collector:
        async with running_worker(kafka_topics, worker_settings(), engine, max_num_seqs=16):
            await produce_requests(kafka_topics, requests)
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 60)
            await collector.wait_until(lambda r: any(s.loaded_adapters for s in r.statuses), 10)
        results = collector.results
    for _, request in requests[:-1]:
        [final] = results.finals[request.id]
        assert final.status == "completed", final
        want = expected[request.id if request.id != "named-base" else "base-0"]
        assert final.token_ids == want, (request.id, final.token_ids, want)
    [unknown] = results.finals["unknown"]
    assert unknown.status == "error" and unknown.reason == "invalid_request"
    assert "no-such-adapter" in unknown.message
    status = [s for s in results.statuses if s.loaded_adapters][-1]
    assert status.adapters == ["alpha", "beta"] and sorted(status.loaded_adapters) == ["alpha", "beta"]
