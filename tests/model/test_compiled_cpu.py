"""One-row steps compiled on the CPU (ENGINE_CPU_COMPILE): a lone request's greedy tokens and log-probabilities
are the eager model's, one graph serves every layer (no compile after start-up), and a family off the Llama
graph is refused naming why."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_quantization import greedy_with_logprobs
from tests.model.batch import tiny_settings
from worker.model.runner import ModelRunner
from worker.model.tiny import build_tiny_family

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours."]


@pytest.mark.slow
def test_a_lone_requests_compiled_steps_give_the_eager_tokens_and_compile_nothing_more(tiny_model_path):
    settings = tiny_settings(num_kv_blocks=128)
    eager = ModelRunner(tiny_model_path, settings)
    compiled = ModelRunner(tiny_model_path, settings.model_copy(update={"cpu_compile": True}))
    assert eager.model.one_row_steps is None and compiled.model.one_row_steps is not None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    expected = greedy_with_logprobs(eager, eager.settings, 24, PROMPTS, at_once=1)
    got = greedy_with_logprobs(compiled, compiled.settings, 24, PROMPTS, at_once=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # all compiled at start-up
    for request_id, tokens in expected.items():
        assert [t for t, _ in got[request_id]] == [t for t, _ in tokens], request_id
        for (_, logprob), (_, other) in zip(got[request_id], tokens):
            assert abs(logprob - other) <= 1e-4, request_id
    # Several requests at once take the eager path in the same runner, with the same tokens.
    together = greedy_with_logprobs(compiled, compiled.settings, 24, PROMPTS)
    assert {k: [t for t, _ in v] for k, v in together.items()} == {
        k: [t for t, _ in v] for k, v in greedy_with_logprobs(eager, eager.settings, 24, PROMPTS).items()}


def test_a_family_off_the_llama_graph_is_refused_naming_why(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    with pytest.raises(ValueError, match="gated MLPs"):
        ModelRunner(path, tiny_settings(cpu_compile=True))


def test_packed_bf16_weights_are_refused_naming_the_settings_that_compile(tiny_model_path):
    with pytest.raises(ValueError, match="ENGINE_CPU_PACKED_WEIGHTS=false"):
        ModelRunner(tiny_model_path, tiny_settings(cpu_compile=True, dtype="bfloat16"))
