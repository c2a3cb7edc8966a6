"""Start-up calibration: time a few real steps of known sizes, so the step-time model (step_time.py) has a
prior before the first request, and a cold worker's admission and shedding estimates (worker/transport/
service_model.py) rest on measurements of this model on this machine rather than on nothing.

It runs throwaway requests through the engine's own path (scheduler, block pool, model, sampler): one small
warm-up request first (first calls pay for lazy initialisation and are not timed), then prefills of a few
sizes up to the token budget and decode steps of a batch of short requests. The timed (tokens, seconds)
samples become the step-time model's fixed prior; the engine is left empty, its counters as they were.
Takes a few seconds on a CPU, milliseconds on a GPU.
"""

from __future__ import annotations

import logging
import time

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.step_time import StepTimeModel

log = logging.getLogger(__name__)

TOKEN_ID = 1000
"""An ordinary token of any vocabulary this worker runs (ids below ~20 are often special tokens)."""


# `engine` below is an LLMEngine, not imported: engine.py owns torch and this module stays pure
# (tests/test_layers.py).


def _run(engine, requests: list[EngineRequest]) -> list[tuple[int, float]]:
    """Add the requests, step until they are all finished; (tokens batched, seconds) of each step."""
    for request in requests:
        engine.add_request(request)
    samples = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        start = time.perf_counter()
        engine.step()
        samples.append((engine.stats().last_step_num_tokens, time.perf_counter() - start))
    return samples


_counter = iter(range(10**9))


def _request(name: str, num_prompt_tokens: int, max_new_tokens: int) -> EngineRequest:
    # A different first token each time: no prefix-cache hit makes a repeated prefill look cheap.
    first = TOKEN_ID + next(_counter) % 1000
    return EngineRequest(request_id=f"calibrate-{name}",
                         prompt_token_ids=[first] + [TOKEN_ID] * (num_prompt_tokens - 1),
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


def calibrate(engine, repeats: int = 2) -> list[tuple[int, float]]:
    """Time steps of several sizes and set them as the engine's step-time prior; returns the points."""
    settings = engine.settings
    budget = settings.max_num_batched_tokens
    limit = max(2, engine.scheduler.max_model_len - 2)
    started = time.perf_counter()
    num_steps, num_preemptions = engine.num_steps, engine.scheduler.num_preemptions
    _run(engine, [_request("warmup", min(8, limit), 2)])
    by_size: dict[int, list[float]] = {}
    prefill_sizes = sorted({min(n, limit) for n in (16, budget // 4, budget // 2, budget)})
    num_seqs = max(1, min(settings.max_num_seqs, 32, budget // 4))
    for repeat in range(repeats):
        for size in prefill_sizes:
            for tokens, seconds in _run(engine, [_request(f"p{size}-{repeat}", size, 1)]):
                by_size.setdefault(tokens, []).append(seconds)
        batch = [_request(f"d{i}-{repeat}", 4, 4) for i in range(num_seqs)]
        for tokens, seconds in _run(engine, batch):
            by_size.setdefault(tokens, []).append(seconds)
    # The fastest of each size's repeats: contention only ever adds time (a neighbour's start-up, a first call
    # at a new shape that the warm-up did not cover), and a prior that is too slow makes a cold worker shed a
    # burst it could serve.
    points = sorted((tokens, min(times)) for tokens, times in by_size.items() if tokens > 0)
    engine.step_time = StepTimeModel()
    engine.step_time.set_prior(points)
    engine.num_steps, engine.scheduler.num_preemptions = num_steps, num_preemptions
    base, per_token = engine.step_time.coefficients()
    log.info("calibrated the step-time model in %.1f s: %d step sizes from %d to %d tokens; step ≈ %.2f ms + "
             "%.3f ms per token", time.perf_counter() - started, len(points), points[0][0], points[-1][0],
             base * 1000, per_token * 1000)
    return points
