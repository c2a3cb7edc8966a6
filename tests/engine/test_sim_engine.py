"""LLMEngine on the simulated accelerator: requests complete, outputs are the simulation's deterministic tokens,
the same in any batch and on every run, sampled ones too; `serve` builds it from the settings alone."""

from __future__ import annotations

import copy
import dataclasses
import numpy as np
import pytest

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.sim import SimRunner


def settings(model_path, **overrides) -> EngineSettings:
    values = dict(model=str(model_path), device="sim:h200", sim_model="llama-3.1-8b", block_size=16,
                  max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, num_kv_blocks=40)
    return EngineSettings(**{**values, **overrides})


def sim_engine(model_path, waits: list[float] | None = None, **overrides) -> LLMEngine:
    waits = [] if waits is None else waits
    engine_settings = settings(model_path, **overrides)
    return LLMEngine(engine_settings, SimRunner(engine_settings, sleep=waits.append))


SAMPLINGS = [SamplingParams(max_new_tokens=12),
             SamplingParams(max_new_tokens=9, temperature=0.8, seed=5),
             SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, top_p=0.9),  # seeded by the engine
             SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.5, seed=11)]


def requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", prompt_token_ids=[200 + 7 * i + j for j in range(5 + 13 * i)],
                          sampling=SAMPLINGS[i % len(SAMPLINGS)]) for i in range(6)]


@pytest.mark.slow
def test_requests_complete_with_the_simulations_tokens_in_any_batch(tiny_model_path):
    waits: list[float] = []
    engine = sim_engine(tiny_model_path, waits)
    together = engine.generate(requests())
    assert all(c.finish_reason == "length" for c in together.values())
    assert [len(together[r.request_id].token_ids) for r in requests()] == [r.sampling.max_new_tokens
                                                                            for r in requests()]
    # Greedy tokens follow the simulation's rule: a function of the previous token and its position.
    runner = engine.runner
    greedy = requests()[0]
    context = list(greedy.prompt_token_ids)
    for token in together["r0"].token_ids:
        assert token == int(runner.next_token_ids(np.array([context[-1]]), np.array([len(context) - 1]))[0])
        context.append(token)
    assert together["r0"].text  # detokenized by the real tokenizer
    # Each request alone, in another order, on fresh engines: the same tokens, sampled ones included.
    for request in reversed(requests()):
        alone = sim_engine(tiny_model_path).generate([request])[request.request_id]
        assert alone.token_ids == together[request.request_id].token_ids, request.request_id
    # The steps waited their simulated time (minus the host work of producing the logits).
    assert len(waits) == engine.num_steps and 0 < sum(waits) <= runner.simulated_s
    engine.scheduler.check_invariants()
    assert engine.runner.inputs.num_rows_in_use == 0  # every request's input row was released


@pytest.mark.slow
def test_preemption_on_the_simulated_device_keeps_outputs(tiny_model_path):
    # 12 blocks of 16 tokens cannot hold six requests at once: some are preempted and recomputed.
    tight_engine = sim_engine(tiny_model_path, num_kv_blocks=12)
    tight = tight_engine.generate(requests())
    roomy = sim_engine(tiny_model_path).generate(requests())
    assert tight_engine.scheduler.num_preemptions > 0
    assert {k: v.token_ids for k, v in tight.items()} == {k: v.token_ids for k, v in roomy.items()}


@pytest.mark.slow  # ~3 s (calibrates an engine): in the full suite, not the fast subset
def test_serve_builds_a_simulated_engine_from_the_settings(tiny_model_path, monkeypatch):
    from worker.serve import build_engine

    monkeypatch.setenv("ENGINE_DEVICE", "sim:h100")
    monkeypatch.setenv("ENGINE_SIM_MODEL", "smollm2-135m")
    monkeypatch.setenv("ENGINE_MODEL", str(tiny_model_path))
    engine_settings = EngineSettings()
    assert (engine_settings.device, engine_settings.sim_model) == ("sim:h100", "smollm2-135m")
    engine = build_engine("llm", engine_settings, 0.0)
    assert isinstance(engine, LLMEngine) and isinstance(engine.runner, SimRunner)
    assert engine.runner.profile.name.startswith("NVIDIA H100")
    assert engine.scheduler.pool.num_blocks == engine.runner.num_blocks > 100_000  # 80 GB less 0.27 GB, in blocks
    assert engine.runner.vocab_size == 49152 and engine.runner.max_model_len == 8192


def test_an_unknown_simulated_model_is_refused(tiny_model_path):
    with pytest.raises(FileNotFoundError, match="llama-3.1-8b"):
        SimRunner(settings(tiny_model_path, sim_model="gpt-5"))


def stepwise(engine: LLMEngine, reqs: list[EngineRequest], abort_at: dict[int, str] | None = None,
             ) -> dict[str, tuple[list[int], str, str | None, list]]:
    """Runs reqs through engine.step(), aborting abort_at[step] before that step; per request: tokens, text,
    finish reason, logprobs."""
    got = {r.request_id: ([], [], None, []) for r in reqs}
    for r in reqs:
        assert engine.add_request(r) == []
    engine.set_input_ended()
    step = 0
    while engine.has_unfinished():
        outs = engine.abort([abort_at[step]]) if abort_at and step in abort_at else []
        for out in outs + engine.step():
            tokens, text, _, logprobs = got[out.request_id]
            tokens += out.new_token_ids
            text.append(out.text_delta)
            logprobs += out.new_logprobs or []
            if out.finished:
                got[out.request_id] = (tokens, text, out.finish_reason, logprobs)
        step += 1
        assert step < 1000
    return {k: (v[0], "".join(v[1]), v[2], [(lp.token_id, round(lp.logprob, 5)) for lp in v[3]])
            for k, v in got.items()}


@pytest.mark.slow  # 2 s: in the full suite, not the fast subset
def test_async_scheduling_gives_the_synchronous_loops_tokens_text_and_endings(tiny_model_path):
    """Greedy, seeded, stop strings, a stop token, logprobs, an abort while the request's step is in flight,
    and preemptions from a tight KV cache: the same outcomes with one step in flight as without."""
    reqs = requests()
    reqs[1].sampling = dataclasses.replace(reqs[1].sampling, logprobs=True, top_logprobs=2)
    runner_tokens = sim_engine(tiny_model_path, async_scheduling="off").generate(reqs)
    # A stop token the sync run really produced (its 4th token) and a stop string from r0's text.
    reqs.append(EngineRequest("stop-token", prompt_token_ids=list(reqs[0].prompt_token_ids), sampling=SamplingParams(
        max_new_tokens=12, stop_token_ids=[runner_tokens["r0"].token_ids[3]])))
    reqs.append(EngineRequest("stop-string", prompt_token_ids=list(reqs[0].prompt_token_ids), sampling=SamplingParams(
        max_new_tokens=12, stop=[runner_tokens["r0"].text[3:6]])))
    results = {}
    for mode in ("off", "on"):
        for blocks in (40, 12):
            engine = sim_engine(tiny_model_path, async_scheduling=mode, num_kv_blocks=blocks)
            assert engine.async_scheduling is (mode == "on")
            results[mode, blocks] = stepwise(engine, [copy.deepcopy(r) for r in reqs], abort_at={3: "r4"})
            if blocks == 12:
                assert engine.scheduler.num_preemptions > 0
            engine.scheduler.check_invariants()
            assert engine.runner.inputs.num_rows_in_use == 0
    for blocks in (40, 12):
        on, off = results["on", blocks], results["off", blocks]
        # The abort lands one step earlier in the output with a step in flight (its outputs come a step later).
        for got in (on["r4"], off["r4"]):
            assert got[2] == "abort" and got[0] == runner_tokens["r4"].token_ids[:len(got[0])]
        on.pop("r4"), off.pop("r4")
        assert on == off
    sync = results["off", 40]
    assert sync["stop-token"][2] == "stop" and sync["stop-string"][2] == "stop"
    assert sync["r1"][3] and len(sync["r1"][3]) == len(sync["r1"][0])


def test_async_scheduling_schedules_the_next_step_while_the_forward_runs(tiny_model_path):
    """The order of the host's calls: the next step is scheduled between a launch and the wait for its
    logits, the draw comes before that wait (on a GPU the sampler's operations queue behind the forward, and the
    simulated step's time counts their bytes: drawing after the wait would add the CPU draw to every step), and
    the previous step's tokens are detokenized after the next launch."""
    engine = sim_engine(tiny_model_path)  # auto: on for a simulated device
    assert engine.async_scheduling
    events: list[str] = []
    runner, scheduler = engine.runner, engine.scheduler
    launch, wait, schedule = runner.launch, runner._wait_until, scheduler.schedule
    postprocess = engine._postprocess_step
    runner.launch = lambda model_input: (launch(model_input), events.append("launch"))[0]
    runner._wait_until = lambda ready_at: (events.append("wait"), wait(ready_at))[1]
    scheduler.schedule = lambda *a, **k: (events.append("schedule"), schedule(*a, **k))[1]
    engine._postprocess_step = lambda flight, updates: (events.append("detok"), postprocess(flight, updates))[1]
    draw = engine.sampler.sample_step
    engine.sampler.sample_step = lambda *a, **k: (events.append("xdraw"), draw(*a, **k))[1]
    engine.generate([EngineRequest("a", prompt_token_ids=list(range(300, 310)),
                                   sampling=SamplingParams(max_new_tokens=4, temperature=0.8, top_k=20))])
    steady = "".join(e[0] for e in events)  # s(chedule) l(aunch) x (draw) w(ait) d(etok)
    # step 1: schedule, launch; then each call: schedule the next, draw and wait the previous, launch, detokenize.
    assert steady.startswith("sl" + "sxwld" * 3), steady

