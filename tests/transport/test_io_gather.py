"""How long the worker's intake and publisher let records gather: a fraction of the engine's last step while
it runs requests, capped, and nothing when idle or disabled."""

from __future__ import annotations

import pytest

from worker.engine.api import EngineStats
from worker.transport.worker import IO_GATHER_STEP_FRACTION, io_gather_s


def test_a_fraction_of_the_last_step_while_the_engine_runs_requests():
    cpu_step = EngineStats(num_running=48, last_step_s=0.9)
    assert io_gather_s(cpu_step, 50.0) == pytest.approx(IO_GATHER_STEP_FRACTION * 0.9)
    gpu_step = EngineStats(num_running=256, last_step_s=0.010)
    assert io_gather_s(gpu_step, 50.0) == pytest.approx(IO_GATHER_STEP_FRACTION * 0.010)  # half a millisecond


def test_capped_and_off_when_idle_or_disabled():
    assert io_gather_s(EngineStats(num_running=8, last_step_s=30.0), 50.0) == 0.05
    assert io_gather_s(EngineStats(num_running=0, last_step_s=0.9), 50.0) == 0.0  # a new request goes at once
    assert io_gather_s(EngineStats(num_running=8, last_step_s=0.9), 0.0) == 0.0
