"""The engine thread: outputs reach asyncio, aborts work; a crashing engine fails the request that crashes it
(found by running each alone) and replays the others from scratch, and never stops the thread."""

import asyncio
import dataclasses
import threading
import time

import pytest

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.instant import InstantEngine, expected_text
from worker.transport.requests.engine_thread import MAX_FAILED_STEPS, EngineThread


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


class PreparedEngine(InstantEngine):
    """Notes on which thread `prepare_thread` ran and how many steps came before it; fails it when asked."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail, self.prepared_on, self.num_steps = fail, [], 0

    def prepare_thread(self) -> None:
        self.prepared_on.append((threading.current_thread().name, self.num_steps))
        if self.fail:
            raise RuntimeError("no kernels")

    def step(self):
        self.num_steps += 1
        return InstantEngine.step(self)


@pytest.mark.parametrize("fail", [False, True])
async def test_the_engine_prepares_the_thread_that_steps_it_before_its_first_step(fail):
    """The model's per-thread kernel caches are built on the engine thread (docs/memory.md); a failure there
    costs memory, never serving."""
    engine = PreparedEngine(fail)
    outputs: asyncio.Queue = asyncio.Queue()
    thread = EngineThread(engine, asyncio.get_running_loop(), outputs)
    thread.start()
    thread.add(request("r"))
    results = await collect(outputs, {"r"})
    assert results["r"][1].finish_reason == "length"
    thread.stop()
    assert engine.prepared_on == [("engine", 0)]


def ids_in(engine: InstantEngine) -> list[str]:
    return list(engine._running) + [item[-1].request.request_id for item in engine._waiting]


class ExplodingEngine(InstantEngine):
    """Fails every step while a request whose id contains "poison" is in it, and loses its state doing so
    (the thread must not rely on the engine remembering what it had)."""

    def step(self):
        if any("poison" in rid for rid in ids_in(self)):
            self._waiting.clear()
            self._running.clear()
            raise RuntimeError("kernel fault")
        return InstantEngine.step(self)


class JoinFailingEngine(InstantEngine):
    """Fails the first step after a request whose id contains `trigger` joins: at every join (a poison that
    fails at its prefill), or at the first join only (`once`: a transient fault nobody causes)."""

    def __init__(self, trigger: str, once: bool) -> None:
        super().__init__(step_time_s=0.001)
        self.trigger = trigger
        self.once = once
        self.num_faults = 0
        self._joined_ids: list[str] = []

    def add_request(self, request):
        self._joined_ids.append(request.request_id)
        return super().add_request(request)

    def step(self):
        joined_ids, self._joined_ids = self._joined_ids, []
        if any(self.trigger in rid for rid in joined_ids) and not (self.once and self.num_faults):
            self.num_faults += 1
            raise RuntimeError("prefill fault")
        return super().step()


class BatchFaultEngine(InstantEngine):
    """Fails every step with two or more requests in it: each request passes its probe alone."""

    def step(self):
        if len(ids_in(self)) >= 2:
            raise RuntimeError("batch fault")
        return super().step()


class BrokenEngine(InstantEngine):
    """Fails every step until `broken` is cleared."""

    broken = True

    def step(self):
        if self.broken:
            raise RuntimeError("device lost")
        return super().step()


class FailingAddEngine(InstantEngine):
    def add_request(self, request):
        if "poison" in request.request_id:
            raise ValueError("cannot tokenize")
        return super().add_request(request)


def started(engine: InstantEngine) -> tuple[EngineThread, asyncio.Queue]:
    outputs: asyncio.Queue = asyncio.Queue()
    thread = EngineThread(engine, asyncio.get_running_loop(), outputs)
    thread.start()
    return thread, outputs


def arrived(r: EngineRequest, ago_s: float = 1.0) -> EngineRequest:
    return dataclasses.replace(r, arrival_time=time.monotonic() - ago_s)


async def collect_outputs(outputs: asyncio.Queue, ids: set[str], seen: list | None = None, timeout=10.0) -> dict:
    """Every output of each request in order (after those already `seen`), until each has a final."""
    by_id: dict[str, list] = {rid: [] for rid in ids}
    for out in seen or []:
        by_id.setdefault(out.request_id, []).append(out)
    async with asyncio.timeout(timeout):
        while not all(by_id[rid] and by_id[rid][-1].finished for rid in ids):
            for out in await outputs.get():
                by_id.setdefault(out.request_id, []).append(out)
    return by_id


async def outputs_until_a_token(outputs: asyncio.Queue, ids: set[str]) -> list:
    """Outputs until each of `ids` has sent a token, so a failure after them interrupts each mid-answer."""
    seen: list = []
    async with asyncio.timeout(5):
        while not ids <= {out.request_id for out in seen if out.new_token_ids}:
            seen += await outputs.get()
    return seen


def assert_replayed_then_complete(r: EngineRequest, outs: list, num_markers=1) -> None:
    """The client's view: a marker per replay; before the last one a prefix of the answer (nothing a probe
    made); after it exactly the answer, then one final."""
    markers = [i for i, out in enumerate(outs) if out.replayed]
    assert len(markers) == num_markers, outs
    for i in markers:
        assert outs[i].new_token_ids == [] and outs[i].text_delta == "" and not outs[i].finished
        assert outs[i].arrival_time == r.arrival_time
    before, after = outs[:markers[-1]], outs[markers[-1] + 1:]
    assert not any(out.finished for out in before)
    assert expected_text(r).startswith("".join(out.text_delta for out in before))
    assert "".join(out.text_delta for out in after) == expected_text(r)
    assert [out.finished for out in after] == [False] * (len(after) - 1) + [True]
    assert after[-1].finish_reason == "length" and after[-1].arrival_time == r.arrival_time


def assert_one_poison_final(outs: list, fault: str) -> None:
    assert len(outs) == 1, outs  # nothing its probe made
    assert outs[0].finished and outs[0].finish_reason == "error" and outs[0].error_code == "poison_request"
    assert fault in outs[0].error_message


async def assert_serves_a_new_request(thread: EngineThread, outputs: asyncio.Queue) -> None:
    after = request("after", n=3)
    thread.add(after)
    outs = (await collect_outputs(outputs, {"after"}))["after"]
    assert "".join(out.text_delta for out in outs) == expected_text(after)
    assert outs[-1].finish_reason == "length" and not any(out.replayed for out in outs)
    assert thread.alive


async def test_a_poison_request_ends_alone_and_the_others_start_over(caplog):
    engine = ExplodingEngine(step_time_s=0.001)
    thread, outputs = started(engine)
    long = [arrived(request(f"long{i}", n=200), ago_s=i + 1) for i in range(2)]
    for r in long:
        thread.add(r)
    seen = await outputs_until_a_token(outputs, {r.request_id for r in long})
    # "short" can finish inside its probe's steps: that final must not reach the loop either.
    short = arrived(request("short", n=2))
    thread.add(request("poison-1", n=5))
    thread.add(short)
    results = await collect_outputs(outputs, {"poison-1", "short", "long0", "long1"}, seen)
    assert_one_poison_final(results["poison-1"], "kernel fault")
    for r in [*long, short]:
        assert_replayed_then_complete(r, results[r.request_id])
    assert thread.num_engine_errors == 1 and thread.num_poison_requests == 1
    assert any("poison-1" in rec.getMessage() and "replaying 3" in rec.getMessage() for rec in caplog.records)
    await assert_serves_a_new_request(thread, outputs)
    assert not engine.has_unfinished()
    thread.stop()


@pytest.mark.parametrize("once", [False, True], ids=["prefill-poison", "transient"])
async def test_a_fault_at_the_first_step_after_a_join(once):
    engine = JoinFailingEngine("trigger", once=once)
    thread, outputs = started(engine)
    bystander = arrived(request("bystander", n=50))
    thread.add(bystander)
    seen = await outputs_until_a_token(outputs, {"bystander"})
    trigger = arrived(request("trigger", n=4))
    thread.add(trigger)
    results = await collect_outputs(outputs, {"bystander", "trigger"}, seen)
    assert_replayed_then_complete(bystander, results["bystander"])
    if once:  # its probe passes: it was not the cause, so it starts over like the others
        assert_replayed_then_complete(trigger, results["trigger"])
        assert thread.num_poison_requests == 0 and engine.num_faults == 1
    else:
        assert_one_poison_final(results["trigger"], "prefill fault")
        assert thread.num_poison_requests == 1 and engine.num_faults == 2  # the step, then its probe
    await assert_serves_a_new_request(thread, outputs)
    thread.stop()


async def test_a_fault_no_request_causes_alone_ends_at_the_replay_bound():
    thread, outputs = started(BatchFaultEngine())
    thread.add(request("a", n=5))
    thread.add(request("b", n=5))
    results = await collect_outputs(outputs, {"a", "b"})
    for outs in results.values():
        assert sum(out.replayed for out in outs) == MAX_FAILED_STEPS
        assert [out.finished for out in outs].count(True) == 1
        assert outs[-1].finish_reason == "error" and outs[-1].error_code == "internal"
        assert "batch fault" in outs[-1].error_message
    assert thread.num_engine_errors == MAX_FAILED_STEPS + 1 and thread.num_poison_requests == 0
    await assert_serves_a_new_request(thread, outputs)
    thread.stop()


async def test_an_engine_failing_every_step_answers_each_request_once_and_the_thread_survives():
    engine = BrokenEngine()
    thread, outputs = started(engine)
    thread.add(request("a", n=3))
    thread.add(request("b", n=3))
    results = await collect_outputs(outputs, {"a", "b"})
    # Each one fails alone too: an engine fault, not two poison requests. Answered once each, no loop.
    for outs in results.values():
        (final,) = outs
        assert final.finished and final.error_code == "internal" and "device lost" in final.error_message
    assert thread.alive
    engine.broken = False
    await assert_serves_a_new_request(thread, outputs)
    thread.stop()


async def test_a_request_the_engine_cannot_add_is_poison():
    thread, outputs = started(FailingAddEngine())
    thread.add(request("poison-add", n=3))
    results = await collect_outputs(outputs, {"poison-add"})
    assert_one_poison_final(results["poison-add"], "cannot tokenize")
    await assert_serves_a_new_request(thread, outputs)
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


class StaticPoisonEngine(WindowEngine):
    """A static batch (starts only when input ends) whose step fails while "poison" runs, once `armed`."""

    def __init__(self) -> None:
        super().__init__(window_s=None)
        self.step_time_s = 0.005
        self.armed = False

    def step(self):
        if self.armed and "poison" in self._running:
            raise RuntimeError("kernel fault")
        return super().step()


async def test_a_static_batch_probes_each_request_and_waits_again_after():
    engine = StaticPoisonEngine()
    thread, outputs = started(engine)
    member = arrived(request("member", n=30))
    thread.add(member)
    thread.add(request("poison", n=30))
    thread.set_input_ended(True)
    seen = await outputs_until_a_token(outputs, {"member", "poison"})
    thread.set_input_ended(False)  # more requests flow: the next batch waits to fill
    async with asyncio.timeout(5):
        while engine.input_ended:
            await asyncio.sleep(0.001)
    engine.armed = True
    # A lone probe runs although the batch is not full (else the poison would pass as innocent) ...
    results = await collect_outputs(outputs, {"poison"}, seen)
    assert results["poison"][-1].error_code == "poison_request"
    # ... and after it the end of input is as the transport last said: the replayed member waits for it.
    assert not engine.input_ended
    await asyncio.sleep(0.1)
    assert outputs.empty() and sum(out.replayed for out in results["member"]) == 1
    thread.set_input_ended(True)
    results = await collect_outputs(outputs, {"member"}, results["member"])
    assert_replayed_then_complete(member, results["member"])
    thread.stop()


class _ClosingEngine(InstantEngine):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail, self.num_closed = fail, 0

    def close(self) -> None:
        self.num_closed += 1
        if self.fail:
            raise RuntimeError("close failed")


@pytest.mark.parametrize("fail", [False, True])
async def test_stopping_the_thread_closes_its_engine_once(fail, caplog):
    """What the engine runs beside the thread (LLMEngine's grammar judge processes) ends with the thread; a close
    that fails is logged and the thread still ends."""
    engine = _ClosingEngine(fail)
    thread = EngineThread(engine, asyncio.get_running_loop(), asyncio.Queue())
    thread.start()
    thread.stop()
    assert not thread.alive and engine.num_closed == 1
    assert ("engine.close() failed" in caplog.text) == fail


@pytest.mark.slow
async def test_stopping_the_thread_ends_its_engines_grammar_judges(tiny_model_path, monkeypatch):
    """The outcome: after a worker's engine thread stops, no judge process of its engine is left running."""
    import json

    from tests.engine.test_structured_output import tiny_engine
    from tests.model.test_grammar import judges_gone
    from worker.engine.api import StructuredOutput

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)  # so an ordinary enum goes to a judge
    engine = tiny_engine(tiny_model_path)
    spec = json.dumps({"enum": [f"v{i}" for i in range(300)]})
    request = EngineRequest("enum", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(
        max_new_tokens=8, structured=StructuredOutput("json_schema", spec)))
    assert engine.generate([request])["enum"].finish_reason in ("stop", "length")
    pids = engine.structured.compiler._judges.pids
    assert pids and not judges_gone(pids, timeout=0.1)
    thread = EngineThread(engine, asyncio.get_running_loop(), asyncio.Queue())
    thread.start()
    thread.stop()
    assert judges_gone(pids)
