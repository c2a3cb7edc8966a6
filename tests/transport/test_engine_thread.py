"""The engine thread: outputs reach asyncio, aborts work, a crashing engine fails requests, not the thread."""

import asyncio

from worker.engine.api import EngineRequest
from worker.engine.instant import InstantEngine, expected_text
from worker.engine.request import SamplingParams
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
