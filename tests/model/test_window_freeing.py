"""A model windowed on every layer (Mistral, window 16) generating ten times its window through our engine, which
gives back the KV blocks behind the window: greedy tokens equal transformers' `generate` token for token through
preemption, chunked prefill and prefix-cache hits on blocks a long request gave back, and the blocks a decoding
request holds stay within window / block_size + 1 (+ 1 with async scheduling, whose next step is already placed)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.scheduler import Scheduler
from worker.model.runner import ModelRunner
from worker.model.tiny import build_tiny_model

WINDOW = 16
NUM_NEW = 160

_rng = random.Random(5)
SHARED = [_rng.randrange(200, 20000) for _ in range(48)]
LONG = SHARED + [_rng.randrange(200, 20000) for _ in range(5)]
OTHER = [_rng.randrange(200, 20000) for _ in range(30)]
THIRD = [_rng.randrange(200, 20000) for _ in range(20)]
SIBLING = SHARED + [_rng.randrange(200, 20000) for _ in range(9)]
LATE_STEP = 120
"""When the late requests arrive: the long one is about 100 tokens in, its shared prefix behind its window."""


@pytest.fixture(scope="module")
def model_path(smollm2_path, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("mistral-window"), smollm2_path, "MistralForCausalLM", seed=3,
                            num_hidden_layers=2, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def greedy(model_path):
    """prompt -> transformers' greedy continuation (cut after an EOS), memoized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos_ids = set(_eos_ids(model_path))
    memo: dict[tuple, list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in memo:
            with torch.inference_mode():
                ids = torch.tensor([prompt])
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                                     pad_token_id=0)[0, len(prompt):].tolist()
            memo[key] = out[: next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))]
        return memo[key]

    return run


def _eos_ids(model_path: Path) -> tuple[int, ...]:
    from worker.model.config import load_config, load_eos_token_ids

    return load_eos_token_ids(model_path, load_config(model_path))


def make_engine(model_path: Path, block_size: int, num_kv_blocks: int, async_scheduling: str = "off",
                freeing: bool = True) -> LLMEngine:
    settings = EngineSettings(
        model=str(model_path), device="cpu", dtype="float32", attention_backend="torch", block_size=block_size,
        num_kv_blocks=num_kv_blocks, max_num_batched_tokens=32, max_num_seqs=4, policy="continuous",
        batch_window_ms=0, enable_prefix_caching=True, async_scheduling=async_scheduling,
    )
    runner = ModelRunner(model_path, settings)
    assert runner.kv_window == WINDOW
    if not freeing:
        runner.kv_window = None  # the scheduler then keeps every block, as for a global-attention model
    return LLMEngine(settings, runner)


def run(engine: LLMEngine, arrivals: list[tuple[int, EngineRequest]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step the engine through the arrivals; (tokens per request, the most blocks each held while decoding)."""
    tokens: dict[str, list[int]] = {}
    most_held: dict[str, int] = {}
    pending = sorted(arrivals, key=lambda item: item[0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            tokens[request.request_id] = []
            assert engine.add_request(request) == []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            assert not out.finished or out.finish_reason in ("stop", "length"), out
        engine.scheduler.check_invariants()
        for request in engine.scheduler.running:
            if request.num_computed_tokens >= request.num_tokens - 1:  # decoding: no prompt chunk in hand
                held = len(request.block_ids) - request.num_freed_blocks
                most_held[request.request_id] = max(most_held.get(request.request_id, 0), held)
        step += 1
        assert step < 3000, "the requests did not finish"
    return tokens, most_held


def request(request_id: str, prompt: list[int], max_new_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, prompt_token_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new_tokens))


@pytest.mark.slow  # transformers' generate of about 700 tokens, and our engine twice: about 30 s
@pytest.mark.parametrize("block_size, async_scheduling", [(4, "off"), (8, "on")])
def test_greedy_matches_generate_ten_windows_on_through_preemption_and_prefix_hits(model_path, greedy, block_size,
                                                                                   async_scheduling):
    long_reference = greedy(LONG, NUM_NEW)
    assert len(long_reference) == NUM_NEW, "the long request was meant to run its whole length"
    # A prompt that is the long request's own prompt and first 64 tokens: its prefix sits in blocks the long
    # request gave back (cached, some evicted by then); it must resume from them or recompute, never misread.
    resumed = LONG + long_reference[:64]
    arrivals = [
        (0, request("long", LONG, NUM_NEW)),
        (0, request("other", OTHER, 120)),
        (2, request("third", THIRD, 100)),
        (LATE_STEP, request("sibling", SIBLING, 40)),
        (LATE_STEP, request("resumed", resumed, 40)),
    ]
    # The smallest pool in which a request of any length fits alone (21 blocks of 4, 11 of 8): four decoding
    # requests hold about 20 blocks of 4, so a prompt chunk beside them preempts one.
    num_kv_blocks = Scheduler.num_blocks_held_at_most(EngineSettings(block_size=block_size,
                                                                     max_num_batched_tokens=32), WINDOW)
    engine = make_engine(model_path, block_size, num_kv_blocks, async_scheduling=async_scheduling)
    assert engine.scheduler.max_model_len > len(resumed) + 40
    tokens, most_held = run(engine, arrivals)
    expected = {r.request_id: greedy(r.prompt_token_ids, r.sampling.max_new_tokens) for _, r in arrivals}
    mismatched = {rid: (tokens[rid], expected[rid]) for rid in expected if tokens[rid] != expected[rid]}
    assert not mismatched, mismatched
    pool = engine.scheduler.pool
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemptions"
    assert pool.num_hit_tokens > 0 and pool.num_window_freed > 0 and pool.num_evictions > 0
    bound = WINDOW // block_size + 1 + (async_scheduling == "on")
    assert max(most_held.values()) <= bound, most_held
    assert pool.num_free_blocks == pool.num_blocks  # every block back, nothing leaked


@pytest.mark.slow  # one long request, twice: about 10 s
@pytest.mark.parametrize("freeing", [True, False])
def test_a_request_generating_ten_windows_holds_only_its_windows_blocks(model_path, greedy, freeing):
    """The bound the freeing keeps; without it the same request holds its whole context (the check can fail)."""
    block_size = 4
    engine = make_engine(model_path, block_size, num_kv_blocks=64, freeing=freeing)
    tokens, most_held = run(engine, [(0, request("long", LONG, NUM_NEW))])
    assert tokens["long"] == greedy(LONG, NUM_NEW)
    bound = WINDOW // block_size + 1
    if freeing:
        assert most_held["long"] <= bound
    else:
        assert most_held["long"] > bound and most_held["long"] == (len(LONG) + NUM_NEW - 2) // block_size + 1
