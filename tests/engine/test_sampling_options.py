"""Penalties, min_tokens and logprobs end to end with the tiny model, against transformers where it has them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine

pytestmark = pytest.mark.slow  # ~4 s (an engine per test): in the full suite, not the fast subset

PROMPTS = [[300 + 17 * i for i in range(12)], [1000, 1001, 1002, 1000, 1001], [4242] * 3 + [77, 78, 79, 80]]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine(EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32",
                                    attention_backend="torch", block_size=16, num_kv_blocks=64,
                                    max_num_batched_tokens=64, max_num_seqs=8))


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def run(engine: LLMEngine, **sampling) -> list:
    requests = [EngineRequest(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(**sampling))
                for i, p in enumerate(PROMPTS)]
    done = engine.generate(requests)
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.slow  # with transformers' reference model: in the full suite, not the fast subset
def test_repetition_penalty_matches_transformers_greedy(engine, hf_model):
    plain = [c.token_ids for c in run(engine, max_new_tokens=16, ignore_eos=True)]
    penalized = [c.token_ids for c in run(engine, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.8)]
    assert penalized != plain
    with torch.inference_mode():
        for prompt, got in zip(PROMPTS, penalized):
            ids = torch.tensor([prompt])
            expected = hf_model.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert got == expected


@pytest.mark.slow  # with transformers' reference model: in the full suite, not the fast subset
def test_frequency_and_presence_penalties_match_a_transformers_logits_processor(engine, hf_model):
    """This model's logits are spread wide (std ~8), so penalties within [-2, 2] may not change its greedy
    choice in a few steps: the output is checked against transformers' generate with the same penalty."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
            self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

        def __call__(self, input_ids, scores):
            counts = torch.zeros_like(scores)
            counts.scatter_add_(1, input_ids[:, self.num_prompt:], torch.ones_like(scores[:, :1]).expand(
                -1, input_ids.shape[1] - self.num_prompt))
            return scores - self.frequency * counts - self.presence * (counts > 0).float()

    for frequency, presence in ((2.0, 0.0), (0.0, 2.0), (-2.0, 1.0)):
        got = [c.token_ids for c in run(engine, max_new_tokens=16, ignore_eos=True, frequency_penalty=frequency,
                                         presence_penalty=presence)]
        with torch.inference_mode():
            for prompt, tokens in zip(PROMPTS, got):
                ids = torch.tensor([prompt])
                processors = LogitsProcessorList([OpenAIPenalties(len(prompt), frequency, presence)])
                expected = hf_model.generate(ids, max_new_tokens=16, do_sample=False, logits_processor=processors,
                                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                assert tokens == expected, (frequency, presence)
    plain = [c.token_ids for c in run(engine, max_new_tokens=16, ignore_eos=True)]
    looping = [c.token_ids for c in run(engine, max_new_tokens=16, ignore_eos=True, frequency_penalty=-2.0)]
    assert looping != plain  # a negative penalty favours repeats, which this model's greedy output has


def test_min_tokens_delays_the_stop_token(engine):
    plain = run(engine, max_new_tokens=12, ignore_eos=True)[0].token_ids
    stop = plain[2]
    first = plain.index(stop)
    stopped = run(engine, max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,))[0]
    assert stopped.token_ids == plain[:first + 1] and stopped.finish_reason == "stop"
    late = run(engine, max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=first + 4)[0]
    assert len(late.token_ids) >= first + 4
    assert stop not in late.token_ids[:first + 3]


@pytest.mark.slow  # with transformers' reference model: in the full suite, not the fast subset
def test_greedy_logprobs_match_transformers_log_softmax(engine, hf_model):
    done = run(engine, max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5)
    with torch.inference_mode():
        for prompt, completion in zip(PROMPTS, done):
            tokens = completion.token_ids
            ids = torch.tensor([prompt + tokens])
            expected = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)  # [T, V]
            got = [lp for out in _outputs(engine, prompt) for lp in out]
            assert [lp.token_id for lp in got] == tokens
            for step, lp in enumerate(got):
                assert lp.logprob == pytest.approx(expected[step, tokens[step]].item(), abs=1e-4)
                assert lp.top_token_ids[0] == tokens[step]  # greedy
                top = expected[step].topk(5)
                assert lp.top_token_ids == top.indices.tolist()
                torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, rtol=0, atol=1e-4)


def _outputs(engine: LLMEngine, prompt: list[int]) -> list:
    """Each step's new_logprobs of one request, through add_request and step()."""
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5)
    assert engine.add_request(EngineRequest("lp", prompt_token_ids=prompt, sampling=sampling)) == []
    steps = []
    while engine.has_unfinished():
        steps += [out.new_logprobs for out in engine.step() if out.new_token_ids]
    return steps


def test_the_engine_counts_its_steps_tokens_and_busy_time(engine):
    before = engine.stats()
    run(engine, max_new_tokens=5, ignore_eos=True)
    after = engine.stats()
    # Prompts of 12, 5 and 7 tokens (no full 16-token block, so no prefix-cache hit) prefilled in one 64-token
    # step that samples each first token, then 4 decode steps of 3 tokens.
    assert after.num_steps - before.num_steps == 5
    assert after.num_batched_tokens - before.num_batched_tokens == sum(map(len, PROMPTS)) + 3 * 4
    assert after.busy_s > before.busy_s and after.last_step_num_tokens == 3
