"""Runs an Engine in its own thread and connects it to the asyncio loop.

The engine is synchronous and may hold the GIL-free parts of a forward pass for tens of milliseconds; the
Kafka loop must keep heartbeating meanwhile, so the engine never runs on the loop. Commands (add, abort, end
of input) go in through a thread-safe queue; each step's outputs come back as one list through
`loop.call_soon_threadsafe` into an asyncio.Queue. The thread steps while the engine's `wake_time()` is due
and otherwise blocks on its command queue until the next command or the wake time (a dynamic batch window
closing, a waiting deadline): it never polls an engine that has nothing to run.

An exception inside the engine must not leave a dead thread and clients waiting on silence: the thread logs
it, tries to abort the affected requests in the engine, answers each with an `error`/`internal` output, and
keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from worker.engine.api import Engine, EngineRequest, EngineStats, RequestOutput

log = logging.getLogger(__name__)


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


def _error_output(request_id: str, message: str) -> RequestOutput:
    now = time.monotonic()
    return RequestOutput(request_id, [], "", finished=True, finish_reason="error", error_code="internal",
                         error_message=message, arrival_time=now, finish_time=now)


class EngineThread:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
        self.engine = engine
        self._loop = loop
        self._outputs = outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: set[str] = set()
        self._stats = EngineStats()
        self.num_engine_errors = 0
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
    def stats(self) -> EngineStats:
        # Replaced wholesale by the engine thread, so the loop thread always reads one consistent snapshot.
        return self._stats

    def _run(self) -> None:
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
                    return
                outputs += self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._seconds_until_due() == 0.0:
                outputs += self._step()
            self._deliver(outputs)
            try:
                self._stats = self.engine.stats()
            except Exception:  # noqa: BLE001 - stats are advisory; a broken stats() must not stop serving
                log.exception("engine.stats() failed")

    def _seconds_until_due(self) -> float | None:
        """0.0 when a step has work now; else how long until it may (None: until a command arrives)."""
        try:
            wake = self.engine.wake_time()
        except Exception:  # noqa: BLE001 - a broken wake_time must not stop serving: step and let step() fail
            log.exception("engine.wake_time() failed")
            return 0.0 if self.engine.has_unfinished() else None
        if wake is None:
            return None
        return max(0.0, wake - time.monotonic())

    def _apply(self, command) -> list[RequestOutput]:
        if isinstance(command, _InputEnded):
            self.engine.set_input_ended(command.ended)
            return []
        if isinstance(command, _Add):
            rid = command.request.request_id
            try:
                outputs = self.engine.add_request(command.request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
                log.exception("engine.add_request failed for %s", rid)
                self.num_engine_errors += 1
                return [_error_output(rid, f"engine rejected the request: {exc!r}")]
            self._in_flight.add(rid)
            return self._settle(outputs)
        try:
            return self._settle(self.engine.abort(command.request_ids))
        except Exception:  # noqa: BLE001
            log.exception("engine.abort failed")
            self.num_engine_errors += 1
            ids = [rid for rid in command.request_ids if rid in self._in_flight]
            self._in_flight.difference_update(ids)
            return [_error_output(rid, "abort failed inside the engine") for rid in ids]

    def _step(self) -> list[RequestOutput]:
        try:
            return self._settle(self.engine.step())
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the worker
            log.exception("engine.step failed; failing %d in-flight requests", len(self._in_flight))
            self.num_engine_errors += 1
            ids = sorted(self._in_flight)
            try:
                self.engine.abort(ids)
            except Exception:  # noqa: BLE001
                log.exception("engine.abort after a failed step also failed")
            self._in_flight.clear()
            return [_error_output(rid, f"engine step failed: {exc!r}") for rid in ids]

    def _settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)
        except RuntimeError:
            # The loop closed under us (shutdown past the drain timeout): nobody is left to read them.
            log.warning("event loop closed; dropping %d engine outputs", len(outputs))
