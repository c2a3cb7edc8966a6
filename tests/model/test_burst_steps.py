"""On the CPU the runner runs a burst's step shapes once at start-up (ModelRunner._run_burst_steps), so that the
code a rebalance's backlog first runs is paged in before traffic (docs/memory.md). They must fit the engine's
limits whatever the settings, and leave nothing behind: no input row held, no K/V in the cache."""

from __future__ import annotations

import pytest

from tests.model.batch import tiny_settings
from worker.model.runner import ModelRunner


@pytest.mark.parametrize("overrides", [
    {},
    {"dtype": "bfloat16"},
    {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 8, "max_model_len": 100},
])
@pytest.mark.slow
def test_burst_steps_fit_the_limits_and_leave_no_trace(tiny_model_path, overrides):
    settings = tiny_settings(**overrides)
    runner = ModelRunner(tiny_model_path, settings)
    steps = runner.burst_steps()
    assert steps
    room = min(runner.max_model_len, runner.num_blocks * runner.block_size)
    for step in steps:
        assert 1 <= len(step) <= settings.max_num_seqs
        assert sum(new for new, _ in step) <= settings.max_num_batched_tokens
        assert all(new >= 1 and cached >= 0 and new + cached <= room for new, cached in step)
    assert any(len(step) == settings.max_num_seqs for step in steps)  # a full batch of decodes
    assert any(cached > 0 and new > 1 for step in steps for new, cached in step)  # a chunk after a context
    assert runner.inputs.num_rows_in_use == 0
    assert not runner.kv_cache.any()
