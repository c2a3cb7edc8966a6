"""End to end: the engine's greedy tokens equal transformers' `generate` for each request alone.

The trace is built to exercise everything at once: different prompt and output lengths, requests arriving
at different steps, a KV cache too small for all of them (preemption by recompute), prompts sharing a
prefix (prefix-cache hits), and a token budget small enough that long prompts are prefilled in chunks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine


def make_trace(num_requests: int = 16, seed: int = 0) -> list[tuple[int, EngineRequest]]:
    """(arrival step, request) pairs; half the prompts share a 40-token prefix (over two full blocks)."""
    rng = random.Random(seed)
    vocab = [t for t in range(200, 20000)]
    shared = [rng.choice(vocab) for _ in range(40)]
    trace = []
    for i in range(num_requests):
        own = [rng.choice(vocab) for _ in range(rng.randint(3, 90))]
        prompt = shared + own if i % 2 == 0 else own
        sampling = SamplingParams(max_new_tokens=rng.randint(1, 20))
        trace.append((rng.randint(0, 12), EngineRequest(f"r{i}", prompt_token_ids=prompt, sampling=sampling)))
    return sorted(trace, key=lambda item: item[0])


def run_trace(engine: LLMEngine, trace: list[tuple[int, EngineRequest]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    pending = list(trace)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            tokens[request.request_id] = []
            assert engine.add_request(request) == []
        if not pending:
            engine.set_input_ended()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out
                finished.add(out.request_id)
        step += 1
        assert step < 5000, "the trace did not finish"
    assert finished == set(tokens)
    return tokens


def hf_reference(model_path: Path, trace, eos_ids) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    expected = {}
    with torch.inference_mode():
        for _, request in trace:
            ids = torch.tensor([request.prompt_token_ids])
            out = model.generate(
                ids, max_new_tokens=request.sampling.max_new_tokens, do_sample=False,
                eos_token_id=list(eos_ids), pad_token_id=0,
            )[0, ids.shape[1]:].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))
            expected[request.request_id] = out[:cut]
    return expected


TRACE = make_trace()


@pytest.fixture(scope="module")
def tiny_expected(tiny_model_path: Path) -> dict[str, list[int]]:
    """transformers' tokens for every request of TRACE, computed once for all policies."""
    return hf_reference(tiny_model_path, TRACE, set(_eos_ids(tiny_model_path)))


def _eos_ids(model_path: Path) -> tuple[int, ...]:
    from worker.model.config import load_config, load_eos_token_ids

    return load_eos_token_ids(model_path, load_config(model_path))


def check_policy(
    model_path: Path, policy: str, num_kv_blocks: int, expected: dict[str, list[int]] | None = None, **overrides
) -> LLMEngine:
    settings = EngineSettings(
        model=str(model_path), device="cpu", dtype="float32", attention_backend="torch", block_size=16,
        num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64, max_num_seqs=8, policy=policy,
        max_batch_size=4, batch_window_ms=0, **overrides,
    )
    engine = LLMEngine(settings)
    got = run_trace(engine, TRACE)
    if expected is None:
        expected = hf_reference(model_path, TRACE, set(engine.runner.eos_token_ids))
    mismatched = {rid: (got[rid], expected[rid]) for rid in expected if got[rid] != expected[rid]}
    assert not mismatched, mismatched
    engine.scheduler.check_invariants()
    return engine


@pytest.mark.slow  # ~5 s with transformers' reference: in the full suite, not the fast subset
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_continuous_matches_transformers_with_preemption_and_prefix_hits(tiny_model_path: Path, tiny_expected,
                                                                          async_scheduling: str) -> None:
    """With async scheduling too: step N+1 scheduled while step N is in flight, its decode inputs written from
    step N's tokens, requests that step N finished (EOS, length) computing one token more that is dropped,
    preemptions of requests whose token is in flight."""
    engine = check_policy(tiny_model_path, "continuous", num_kv_blocks=20, expected=tiny_expected,
                          async_scheduling=async_scheduling)
    assert engine.async_scheduling is (async_scheduling == "on")
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemptions"
    assert engine.scheduler.pool.hit_rate > 0, "the shared prefixes were meant to hit the prefix cache"


@pytest.mark.slow  # ~3 s in all: in the full suite, not the fast subset
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_batch_policies_match_transformers(tiny_model_path: Path, tiny_expected, policy: str,
                                           async_scheduling: str) -> None:
    check_policy(tiny_model_path, policy, num_kv_blocks=48, expected=tiny_expected,
                 async_scheduling=async_scheduling)


@pytest.mark.slow
def test_smollm2_continuous_matches_transformers(smollm2_path: Path) -> None:
    engine = check_policy(smollm2_path, "continuous", num_kv_blocks=24)
    assert engine.scheduler.num_preemptions > 0
