"""The engine thread: outputs reach asyncio, aborts work, a crashing engine fails requests, not the thread."""

import asyncio
import time

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.instant import InstantEngine, expected_text
from worker.transport.engine_thread import EngineThread


async def collect(outputs: asyncio.Queue, ids: set[str], timeout=10.0) -> dict:
    texts: dict[str, str] = {}
    finals: dict = {}
    async with asyncio.timeout(timeout):
        while set(finals) != ids:
            for out in await outputs.get():
                texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
                if out.finished:
                    finals[out.request_id] = out
    return {rid: (texts.get(rid, ""), finals[rid]) for rid in ids}


def request(rid: str, n=5, priority=0) -> EngineRequest:
    return EngineRequest(rid, prompt=f"prompt {rid}", sampling=SamplingParams(max_new_tokens=n), priority=priority)


async def test_outputs_arrive_on_the_loop_and_match_the_engine():
    outputs: asyncio.Queue = asyncio.Queue()
    thread = EngineThread(InstantEngine(max_num_seqs=4), asyncio.get_running_loop(), outputs)
    thread.start()
    requests = [request(f"r{i}", n=3 + i % 4) for i in range(10)]
    for r in requests:
        thread.add(r)
    results = await collect(outputs, {r.request_id for r in requests})
    for r in requests:
        text, final = results[r.request_id]
        assert text == expected_text(r)
        assert final.finish_reason == "length" and final.num_output_tokens == r.sampling.max_new_tokens
    thread.stop()
    assert not thread.alive


async def test_abort_ends_a_long_request():
    outputs: asyncio.Queue = asyncio.Queue()
    thread = EngineThread(InstantEngine(step_time_s=0.01), asyncio.get_running_loop(), outputs)
    thread.start()
    thread.add(request("long", n=10_000))
    await asyncio.sleep(0.05)
    thread.abort(["long"])
    results = await collect(outputs, {"long"})
    assert results["long"][1].finish_reason == "abort"
    thread.stop()


class ExplodingEngine(InstantEngine):
    def step(self):
        if any("boom" in rid for rid in self._running) or any("boom" in i[2].request.request_id for i in self._waiting):
            self._waiting.clear()
            self._running.clear()
            raise RuntimeError("kernel fault")
        return InstantEngine.step(self)


async def test_engine_exception_fails_in_flight_requests_and_thread_keeps_serving():
    outputs: asyncio.Queue = asyncio.Queue()
    thread = EngineThread(ExplodingEngine(), asyncio.get_running_loop(), outputs)
    thread.start()
    thread.add(request("boom", n=3))
    thread.add(request("bystander", n=3))
    results = await collect(outputs, {"boom", "bystander"})
    assert results["boom"][1].finish_reason == "error" and results["boom"][1].error_code == "internal"
    assert results["bystander"][1].finish_reason == "error"
    assert thread.num_engine_errors == 1
    thread.add(request("after", n=2))
    results = await collect(outputs, {"after"})
    assert results["after"][1].finish_reason == "length"
    assert thread.alive
    thread.stop()


class WindowEngine(InstantEngine):
    """Holds its waiting requests until a window closes (like the dynamic policy) or input ends (static)."""

    def __init__(self, window_s: float | None) -> None:
        super().__init__()
        self.window_s = window_s
        self.opened_at: float | None = None
        self.input_ended = False
        self.num_step_calls = 0

    def add_request(self, request):
        self.opened_at = self.opened_at or time.monotonic()
        return super().add_request(request)

    def wake_time(self):
        if self._running:
            return time.monotonic()
        if not self._waiting:
            return None
        if self.input_ended:
            return time.monotonic()
        return None if self.window_s is None else self.opened_at + self.window_s

    def set_input_ended(self, ended=True):
        self.input_ended = ended

    def step(self):
        self.num_step_calls += 1
        return super().step() if self.wake_time() is not None and self.wake_time() <= time.monotonic() else []


async def test_the_thread_sleeps_until_the_wake_time_instead_of_polling():
    outputs: asyncio.Queue = asyncio.Queue()
    engine = WindowEngine(window_s=0.3)
    thread = EngineThread(engine, asyncio.get_running_loop(), outputs)
    thread.start()
    start = time.monotonic()
    thread.add(request("w", n=2))
    results = await collect(outputs, {"w"})
    assert results["w"][1].finish_reason == "length"
    assert time.monotonic() - start >= 0.29  # not before the window closed
    assert engine.num_step_calls <= 4  # two tokens, plus at most a spurious wake or two: no busy wait
    thread.stop()


async def test_the_end_of_input_starts_work_that_waits_for_it():
    outputs: asyncio.Queue = asyncio.Queue()
    engine = WindowEngine(window_s=None)  # like a static batch that is not full: waits for more or the end
    thread = EngineThread(engine, asyncio.get_running_loop(), outputs)
    thread.start()
    thread.add(request("s", n=2))
    await asyncio.sleep(0.2)
    assert outputs.empty() and engine.num_step_calls == 0
    thread.set_input_ended(True)
    results = await collect(outputs, {"s"})
    assert results["s"][1].finish_reason == "length"
    thread.stop()
