"""Start-up calibration runs real steps of several sizes through the engine and leaves it as it was."""

from pathlib import Path

import pytest

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.calibrate import calibrate
from worker.engine.engine import LLMEngine


@pytest.mark.slow
def test_calibration_sets_a_prior_and_leaves_the_engine_empty(tiny_model_path: Path):
    settings = EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32", attention_backend="torch",
                              max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64)
    engine = LLMEngine(settings)
    points = calibrate(engine, repeats=1)
    sizes = [tokens for tokens, _ in points]
    assert min(sizes) <= 16 and max(sizes) == 64 and 8 in sizes  # prefills up to the budget, a decode batch
    assert all(seconds > 0 for _, seconds in points)
    stats = engine.stats()
    assert stats.step_time_base_s + stats.step_time_per_token_s * 64 > 0
    assert not engine.has_unfinished() and stats.num_steps == 0 and stats.num_preemptions == 0
    assert stats.kv_usage == 0.0  # every calibration request's blocks were given back
    done = engine.generate([EngineRequest("after", prompt_token_ids=[1000, 1001, 1002],
                                          sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))])
    assert len(done["after"].token_ids) == 3


def test_the_prior_takes_the_fastest_repeat_of_each_size(monkeypatch):
    """Contention only adds time (a neighbour's start-up, a first call at a new shape), so each size's prior
    point is its fastest repeat, not a middle one that a slow first pass drags up."""
    import worker.engine.calibrate as calibrate_module
    from worker.engine.step_time import StepTimeModel

    runs = iter([
        [(8, 0.5)],  # the untimed warm-up
        [(16, 0.90)], [(32, 0.95)], [(64, 1.0)], [(16, 0.9)],  # repeat 0: every step slowed
        [(16, 0.02)], [(32, 0.03)], [(64, 0.04)], [(16, 0.02)],  # repeat 1: the worker's own speed
    ])
    monkeypatch.setattr(calibrate_module, "_run", lambda engine, requests: next(runs))

    class Engine:  # what calibrate reads and writes
        settings = EngineSettings(model="unused", max_num_batched_tokens=64, max_num_seqs=4)
        scheduler = type("S", (), {"max_model_len": 512, "num_preemptions": 0})()
        num_steps = 0
        step_time = StepTimeModel()

    engine = Engine()
    points = calibrate_module.calibrate(engine, repeats=2)
    assert points == [(16, 0.02), (32, 0.03), (64, 0.04)]
    base, per_token = engine.step_time.coefficients()
    assert base + per_token * 64 < 0.05
