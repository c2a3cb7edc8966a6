"""bench_engine.run_engine drives an engine only through the Engine contract, on a fake clock (no model).

The fake engine admits waiting requests once a batch window closes or the input has ended, like the dynamic
and static policies; its steps take STEP_S of fake time. The replay must step only when wake_time() is due,
sleep exactly until the earlier of wake_time() and the next arrival (never a poll), end the input once after
the last arrival, and record each request's times from the engine's outputs."""

from __future__ import annotations

import pytest

from benchmarks import bench_engine
from benchmarks.lib.trace import Trace, TraceConfig, TraceRequest
from worker.engine.api import EngineStats, RequestOutput

STEP_S = 0.1
WINDOW_S = 0.25


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        """The time each sleep ended at."""

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0, "a sleep of nothing is a poll"
        self.now += seconds
        self.sleeps.append(self.now)


class FakeScheduler:
    block_size = 16
    kv_usage = 0.5

    def __init__(self) -> None:
        self.running: list = []


class FakeRunning:
    def __init__(self, request, arrival: float) -> None:
        self.request, self.arrival = request, arrival
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.num_computed_tokens = len(request.prompt_token_ids)
        self.block_ids = [0] * (-(-(self.num_computed_tokens + request.sampling.max_new_tokens) // 16))


class FakeEngine:
    """Waiting requests start together once the oldest has waited WINDOW_S, or at once after the input ended."""

    def __init__(self, clock: FakeClock, stuck: bool = False) -> None:
        self.clock = clock
        self.stuck = stuck
        """Never admit anyone and never wake: a broken engine the replay must not wait on forever."""
        self.scheduler = FakeScheduler()
        self.waiting: list[FakeRunning] = []
        self.input_ended_calls: list[int] = []
        self.num_added = 0
        self.num_steps = 0

    def add_request(self, request) -> list[RequestOutput]:
        assert not self.input_ended_calls, "a request after the input ended"
        self.waiting.append(FakeRunning(request, request.arrival_time))
        self.num_added += 1
        return []

    def set_input_ended(self, ended: bool = True) -> None:
        self.input_ended_calls.append(self.num_added)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.scheduler.running)

    def wake_time(self) -> float | None:
        if self.stuck:
            return None
        if self.scheduler.running or (self.waiting and self.input_ended_calls):
            return self.clock.now
        return self.waiting[0].arrival + WINDOW_S if self.waiting else None

    def step(self) -> list[RequestOutput]:
        wake = self.wake_time()
        assert wake is not None and wake <= self.clock.now, "stepped while nothing was due"
        if not self.scheduler.running:
            self.scheduler.running, self.waiting = self.waiting, []
        self.clock.now += STEP_S
        self.num_steps += 1
        outputs = []
        for r in list(self.scheduler.running):
            r.num_output_tokens += 1
            r.first_token_time = r.first_token_time or self.clock.now
            if r.num_output_tokens == r.request.sampling.max_new_tokens:
                self.scheduler.running.remove(r)
                outputs.append(RequestOutput(r.request.request_id, [1], "x", finished=True, finish_reason="length",
                                             num_output_tokens=r.num_output_tokens, arrival_time=r.arrival,
                                             first_token_time=r.first_token_time, finish_time=self.clock.now))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(num_steps=self.num_steps)


def _trace(arrivals: list[float], max_new_tokens: int = 2) -> Trace:
    requests = [TraceRequest(f"r{i}", t, [20, 21, 22], max_new_tokens, 1, "short") for i, t in enumerate(arrivals)]
    return Trace(TraceConfig(rate=1.0, num_requests=len(requests)), requests)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(bench_engine, "time", clock)
    return clock


def test_steps_when_due_and_sleeps_until_the_window_or_the_next_arrival(clock):
    engine = FakeEngine(clock)
    start = clock.now
    run = bench_engine.run_engine(engine, _trace([0.0, 0.1, 1.0]), "dynamic")

    # Sleeps end at r1's arrival (0.1), at r0's window closing (0.25: r0 and r1 start together and finish
    # after two steps) and at r2's arrival (1.0); r2 is the last request, so the input ends and it starts at once.
    assert [round(t - start, 6) for t in clock.sleeps] == [0.1, 0.25, 1.0]
    records = {r.request_id: r for r in run.records}
    assert records["r0"].first_token_s == pytest.approx(0.35) and records["r0"].finish_s == pytest.approx(0.45)
    assert records["r1"].finish_s == pytest.approx(0.45)
    assert records["r2"].first_token_s == pytest.approx(1.1) and records["r2"].finish_s == pytest.approx(1.2)
    assert all(r.num_output_tokens == 2 and r.error is None for r in run.records)
    assert run.wall_s == pytest.approx(1.2)
    assert engine.input_ended_calls == [3]  # once, right after the last arrival
    # One KV sample per step; the replay itself never stepped an engine with nothing due (FakeEngine.step).
    assert engine.num_steps == 4 and len(run.kv_pool_usage) == 4 and run.max_concurrent == 2
    assert run.extra["num_steps"] == 4


def test_offline_trace_ends_the_input_before_the_first_step(clock):
    engine = FakeEngine(clock)
    run = bench_engine.run_engine(engine, _trace([0.0, 0.0, 0.0], max_new_tokens=3), "static")
    assert clock.sleeps == []  # everything arrived at t=0 and the input ended: no window to wait for
    assert engine.input_ended_calls == [3] and engine.num_steps == 3
    assert [r.finish_s for r in run.records] == pytest.approx([0.3, 0.3, 0.3])


def test_an_engine_that_never_wakes_fails_the_run_instead_of_hanging(clock):
    with pytest.raises(RuntimeError, match="wake_time"):
        bench_engine.run_engine(FakeEngine(clock, stuck=True), _trace([0.0, 0.5]), "static")
    assert len(clock.sleeps) == 1  # until the second arrival, then nothing left to wait for
