"""Runs an Engine in its own thread and connects it to the asyncio loop.

The engine is synchronous and may hold the GIL-free parts of a forward pass for tens of milliseconds; the
Kafka loop must keep heartbeating meanwhile, so the engine never runs on the loop. Commands (add, abort, end
of input) go in through a thread-safe queue; each step's outputs come back as one list (and what commands
ended, such as an abort's finals, as one list before the next step) through
`loop.call_soon_threadsafe` into an asyncio.Queue. The thread steps while the engine's `wake_time()` is due
and otherwise blocks on its command queue until the next command or the wake time (a dynamic batch window
closing, a waiting deadline): it never polls an engine that has nothing to run.

An exception inside the engine must not leave a dead thread and clients waiting on silence, nor fail a whole
batch for one bad request. When `step()` raises, the thread aborts every request in flight (so the engine's
state is clean), then runs each of them alone on the empty engine for a few steps (a probe, whose outputs
are dropped). A request whose probe raises is poison: it ends with `error`/`poison_request`. Every other one
gets a `replayed` marker and is added again from its original `EngineRequest`, to start over. A request
caught in a failing step more than `MAX_FAILED_STEPS` times in all ends with `error`/`internal` instead, so a
failure that no request causes alone (one that depends on the batch size, say) cannot replay forever; and when
every one of several requests fails alone, the engine itself is at fault (a lost device, say): they all end
with `internal`, and none is set aside as poison. An
`add_request` that raises marks its request poison the same way; a failing `abort` fails the requests it was
meant to abort with `internal`. The thread logs each failure and keeps serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

from worker.engine.api import Engine, EngineRequest, EngineStats, RequestOutput
from worker.memory import prepare_thread as prepare_allocator

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 2
"""A request caught in this many failing steps has been probed alone and replayed each time; the next
failing step it is caught in ends it with `internal`."""
PROBE_STEPS = 3
"""A poison request fails at its prefill or first decode (a bad prompt, a bad token id, a sampling setting
the kernels mishandle): step 1 runs the prefill, step 2 the first decode, a third covers a prefill chunked
over two steps. More would slow a recovery with many requests in flight (each is probed in turn, and the
loop's commands wait meanwhile) for little gain."""
PROBE_MAX_WAIT_S = 0.5
"""Longest a probe sleeps for the engine's wake time (a dynamic batch window); past it the probe steps anyway."""


@dataclass(slots=True)
class _Add:
    request: EngineRequest


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _InputEnded:
    ended: bool


_STOP = object()


@dataclass(slots=True)
class _InFlight:
    request: EngineRequest
    """As the transport made it, arrival_time stamped: what a replay adds again from scratch."""
    num_failed_steps: int = 0


def _error_output(request: EngineRequest, code: str, message: str) -> RequestOutput:
    now = time.monotonic()
    arrival = request.arrival_time if request.arrival_time is not None else now
    return RequestOutput(request.request_id, [], "", finished=True, finish_reason="error", error_code=code,
                         error_message=message, arrival_time=arrival, finish_time=now)


def _replayed_marker(request: EngineRequest) -> RequestOutput:
    return RequestOutput(request.request_id, [], "", replayed=True, arrival_time=request.arrival_time or 0.0)


class EngineThread:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
        self.engine = engine
        self._loop = loop
        self._outputs = outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[str, _InFlight] = {}
        """By request id, in the order they were added (the order probes run in)."""
        self._input_ended = False
        self._stats = EngineStats()
        self.num_engine_errors = 0
        self.num_poison_requests = 0
        self.num_replays = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, request: EngineRequest) -> None:
        self._commands.put(_Add(request))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    def set_input_ended(self, ended: bool) -> None:
        """Engine.set_input_ended, from the loop: the transport says whether its consumer has caught up."""
        self._commands.put(_InputEnded(ended))

    def stop(self, timeout: float | None = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests handed to the engine whose final output has not come back (their replay records)."""
        return len(self._in_flight)

    @property
    def stats(self) -> EngineStats:
        # Replaced wholesale by the engine thread, so the loop thread always reads one consistent snapshot.
        return self._stats

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        self._prepare_engine()
        while True:
            outputs: list[RequestOutput] = []
            try:
                wait_s = self._seconds_until_due()
                command = self._commands.get(block=wait_s != 0.0, timeout=wait_s)
            except queue.Empty:
                command = None
            while command is not None:
                if command is _STOP:
                    self._deliver(outputs)
                    self._close_engine()
                    return
                outputs += self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if outputs:
                # What the commands ended (an abort's final, a refused add) goes out now, not a step later.
                self._deliver(outputs)
                outputs = []
            if self._seconds_until_due() == 0.0:
                outputs += self._step()
            self._deliver(outputs)
            try:
                self._stats = self.engine.stats()
            except Exception:  # stats are advisory; a broken stats() must not stop serving
                log.exception("engine.stats() failed")
            else:
                self._stats_updated(self._stats)

    def _prepare_engine(self) -> None:
        """What the engine builds per thread (the model's kernel caches) is built for this one, which steps it,
        after the allocator's per-thread choices (numpy's buffer cache); a failure costs memory, never serving."""
        try:
            prepare_allocator()
        except Exception:
            log.exception("the allocator's per-thread settings failed")
        self._call_engine("prepare_thread")

    def _close_engine(self) -> None:
        """What the engine runs beside this thread (the grammar judges' processes) ends with it, not at exit;
        a failed close must not keep the thread alive."""
        self._call_engine("close")

    def _call_engine(self, name: str) -> None:
        """The engine's optional method `name`, where it has one; a failure is logged and the thread goes on."""
        method = getattr(self.engine, name, None)
        if method is None:
            return
        try:
            method()
        except Exception:
            log.exception("engine.%s() failed", name)

    def _stats_updated(self, stats: EngineStats) -> None:
        """After each round of commands and step (engine_process.py sends them to its parent)."""

    def _seconds_until_due(self) -> float | None:
        """0.0 when a step has work now; else how long until it may (None: until a command arrives)."""
        try:
            wake = self.engine.wake_time()
        except Exception:  # a broken wake_time must not stop serving: step and let step() fail
            log.exception("engine.wake_time() failed")
            return 0.0 if self.engine.has_unfinished() else None
        if wake is None:
            return None
        return max(0.0, wake - time.monotonic())

    def _apply(self, command) -> list[RequestOutput]:
        if isinstance(command, _InputEnded):
            self._input_ended = command.ended
            self._tell_input_ended(command.ended)
            return []
        if isinstance(command, _Add):
            request = command.request
            if request.arrival_time is None:
                # Stamped here so that a replay keeps the arrival the engine gave it the first time.
                request = dataclasses.replace(request, arrival_time=time.monotonic())
            return self._admit(_InFlight(request))
        return self._abort(command.request_ids)

    def _admit(self, flight: _InFlight) -> list[RequestOutput]:
        request = flight.request
        try:
            outputs = self.engine.add_request(request)
        except Exception as exc:  # one bad request must not stop the others
            log.exception("engine.add_request failed for %s: poison", request.request_id)
            self.num_engine_errors += 1
            self.num_poison_requests += 1
            return [_error_output(request, "poison_request", f"the engine failed to add the request: {exc!r}")]
        self._in_flight[request.request_id] = flight
        return self._settle(outputs)

    def _abort(self, request_ids: list[str]) -> list[RequestOutput]:
        try:
            return self._settle(self.engine.abort(request_ids))
        except Exception:
            log.exception("engine.abort failed")
            self.num_engine_errors += 1
            flights = [self._in_flight.pop(rid) for rid in request_ids if rid in self._in_flight]
            return [_error_output(f.request, "internal", "abort failed inside the engine") for f in flights]

    def _tell_input_ended(self, ended: bool) -> None:
        try:
            self.engine.set_input_ended(ended)
        except Exception:  # the end of input is a batching hint; losing it must not stop serving
            log.exception("engine.set_input_ended(%s) failed", ended)

    def _step(self) -> list[RequestOutput]:
        try:
            return self._settle(self.engine.step())
        except Exception as exc:  # a failed step fails its poison requests, not the worker
            log.exception("engine.step failed with %d requests in flight; probing each alone", len(self._in_flight))
            self.num_engine_errors += 1
            step_error = f"engine step failed: {exc!r}"
        # Outside the except block, so a probe's failure is logged on its own, not chained to this one.
        return self._recover(step_error)

    def _recover(self, step_error: str) -> list[RequestOutput]:
        """After a failed step: which requests in flight are poison, and which start over."""
        flights = list(self._in_flight.values())
        self._in_flight.clear()
        self._abort_quietly([f.request.request_id for f in flights])
        outputs: list[RequestOutput] = []
        suspects: list[_InFlight] = []
        for flight in flights:
            flight.num_failed_steps += 1
            if flight.num_failed_steps > MAX_FAILED_STEPS:
                outputs.append(_error_output(flight.request, "internal", (
                    f"{step_error}; this request was in {flight.num_failed_steps} failing steps, "
                    "but never failed alone")))
            else:
                suspects.append(flight)
        innocents = self._probe_all(suspects, outputs)
        self.num_replays += len(innocents)
        for flight in innocents:
            outputs.append(_replayed_marker(flight.request))
            outputs += self._admit(flight)
        return outputs

    def _probe_all(self, suspects: list[_InFlight], outputs: list[RequestOutput]) -> list[_InFlight]:
        """Probes each suspect alone; appends a final for each poison one to `outputs`, returns the others."""
        # A static batch would wait to fill before running a lone probe: say input has ended while probing.
        self._tell_input_ended(True)
        innocents = []
        failed: list[tuple[_InFlight, Exception]] = []
        for flight in suspects:
            failure = self._probe(flight.request)
            if failure is None:
                innocents.append(flight)
            else:
                failed.append((flight, failure))
        self._tell_input_ended(self._input_ended)
        if len(failed) > 1 and not innocents:
            # Every request fails alone: the engine is broken (a dead device, say), not the requests. Their
            # records are not set aside as poison; they end in `internal` errors.
            log.error("every one of %d requests fails alone: an engine fault, not poison requests", len(failed))
            for flight, failure in failed:
                outputs.append(_error_output(flight.request, "internal",
                                             f"the engine fails with any request, this one too: {failure!r}"))
            return []
        poison_ids = []
        for flight, failure in failed:
            poison_ids.append(flight.request.request_id)
            outputs.append(_error_output(flight.request, "poison_request",
                                         f"the engine fails with this request alone: {failure!r}"))
        self.num_poison_requests += len(poison_ids)
        log.warning("after a failed step: poison %s; replaying %d requests", poison_ids or "none", len(innocents))
        return innocents

    def _probe(self, request: EngineRequest) -> Exception | None:
        """What the engine raises when running `request` alone for up to PROBE_STEPS steps, if anything. Its
        outputs are dropped: the client only ever sees the replay that follows."""
        try:
            self.engine.add_request(request)
            for _ in range(PROBE_STEPS):
                wake = self.engine.wake_time()
                if wake is None:
                    break  # finished, or nothing more can run
                time.sleep(min(max(0.0, wake - time.monotonic()), PROBE_MAX_WAIT_S))
                self.engine.step()
        except Exception as exc:  # the failure is the finding
            log.exception("probe of %s failed: poison", request.request_id)
            return exc
        finally:
            self._abort_quietly([request.request_id])
        return None

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """Aborts in the engine and drops the outputs: for requests the thread already answers otherwise."""
        try:
            self.engine.abort(request_ids)
        except Exception:
            log.exception("engine.abort of %d requests after a failed step also failed", len(request_ids))

    def _settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._in_flight.pop(out.request_id, None)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)
        except RuntimeError:
            # The loop closed under us (shutdown past the drain timeout): nobody is left to read them.
            log.warning("event loop closed; dropping %d engine outputs", len(outputs))


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS too (Linux; best effort; Python < 3.14 names only its own
    object), so that `top -H`, /proc/<pid>/task/*/comm and the overload benchmark's CPU accounting can tell the
    engine thread from the transport's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
