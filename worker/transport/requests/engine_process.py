"""The engine core in its own process (`WORKER_ENGINE_PROCESS=true`), behind EngineThread's interface.

In one process the engine thread and the asyncio transport share one GIL: on a GPU, where the engine's host
work is the pace-setter, every stretch of pure Python the transport runs (decoding records, building and
publishing chunks) delays the engine thread's next launch. vLLM v1 and SGLang run their engine core in a
process of its own for that reason; so does this, on request.

- `EngineProcess.spawn(build)` starts a child process (spawn, not fork: the parent may hold threads and
  locks) that calls `build()` (a picklable callable: `functools.partial(serve.build_engine, ...)`, so this
  module never imports the model side) and then runs an ordinary `EngineThread` around the engine. It returns
  once the engine is built (model loaded, step times calibrated) or raises with the child's error, so a worker
  joins its consumer group only with a ready engine, as in one process.
- `attach(loop, outputs)` gives the transport EngineThread's interface: `start`, `add`, `abort`,
  `set_input_ended`, `stop`, `alive` and `stats`. Commands go down a pipe; the child's engine thread sends each
  list of outputs up the same pipe with the engine's stats, and a reader thread of the parent puts the list
  on the asyncio queue, as the engine thread does in one process. Failure handling (poison requests, replays)
  is the child's EngineThread's, unchanged.
- If the child dies, `alive` turns false and the reader logs it; the worker's in-flight requests stay
  unanswered and uncommitted, so a restart (or another worker, after a rebalance) redoes them.

What crosses the pipe is pickled: EngineRequest down, RequestOutput lists and EngineStats up (plain dataclasses
of worker/engine/api.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from worker.engine.api import Engine, EngineRequest, EngineStats, RequestOutput
from worker.transport.requests.engine_thread import EngineThread

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.02
"""The child sends the engine's stats at least this often while it steps (and with every list of outputs)."""


class _PipeEngineThread(EngineThread):
    """The child's EngineThread: outputs and stats go up the pipe instead of onto an asyncio queue."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        super().__init__(engine, None, None)
        self._conn = conn
        self._send_lock = threading.Lock()
        self._stats_sent_at = 0.0

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._stats_sent_at = time.monotonic()
            self.send(("out", outputs, self.engine.stats()))

    def _stats_updated(self, stats: EngineStats) -> None:
        now = time.monotonic()
        if now - self._stats_sent_at >= STATS_INTERVAL_S:
            self._stats_sent_at = now
            self.send(("stats", stats))


def _child_main(conn: Connection, build: Callable[[], Engine], log_level: int) -> None:
    # Ctrl-C reaches the whole process group: the parent drains its requests through this engine, which stops
    # when the parent says so (or when the pipe closes because the parent is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s")
    try:
        engine = build()
    except BaseException as exc:  # the parent reports why the engine could not start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    thread = _PipeEngineThread(engine, conn)
    thread.send(("ready", engine.stats()))
    thread.start()
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nothing is left to serve
            thread.stop()
            return
        kind = command[0]
        if kind == "add":
            thread.add(command[1])
        elif kind == "abort":
            thread.abort(command[1])
        elif kind == "input_ended":
            thread.set_input_ended(command[1])
        elif kind == "stop":
            thread.stop()
            thread.send(("stopped",))
            return


class EngineProcess:
    """The parent's side: spawn() the child, then attach() it to the worker's loop."""

    def __init__(self, process, conn: Connection, stats: EngineStats) -> None:
        self._process = process
        self._conn = conn
        self._stats = stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._reader: threading.Thread | None = None
        self._stopped = threading.Event()

    @classmethod
    def spawn(cls, build: Callable[[], Engine], timeout_s: float = 600.0) -> "EngineProcess":
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, args=(child_conn, build, logging.getLogger().level),
                              name="engine-core", daemon=True)
        process.start()
        child_conn.close()
        deadline = time.monotonic() + timeout_s
        while not parent_conn.poll(0.5):
            if not process.is_alive() or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the engine process did not start (exit code {process.exitcode})")
        message = parent_conn.recv()
        if message[0] != "ready":
            process.join(5)
            raise RuntimeError(f"the engine process failed to build its engine: {message[1]}")
        log.info("engine core running in process %d", process.pid)
        return cls(process, parent_conn, message[1])

    # ---- EngineThread's interface ------------------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> "EngineProcess":
        self._loop, self._outputs = loop, outputs
        return self

    def start(self) -> None:
        assert self._loop is not None, "attach() first"
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def add(self, request: EngineRequest) -> None:
        self._send(("add", request))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(("abort", list(request_ids)))

    def set_input_ended(self, ended: bool) -> None:
        self._send(("input_ended", ended))

    def stop(self, timeout: float | None = 10.0) -> None:
        self._send(("stop",))
        self._stopped.wait(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    # ---- internals ---------------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError):  # the child is gone; alive says so, and its requests stay unanswered
            log.error("engine process unreachable; dropped %s", message[0])

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopped.is_set():
                    log.error("the engine process exited (code %s)", self._process.exitcode)
                self._stopped.set()
                return
            kind = message[0]
            if kind == "out":
                self._stats = message[2]
                try:
                    self._loop.call_soon_threadsafe(self._outputs.put_nowait, message[1])
                except RuntimeError:
                    log.warning("event loop closed; dropping %d engine outputs", len(message[1]))
            elif kind == "stats":
                self._stats = message[1]
            elif kind == "stopped":
                self._stopped.set()
                return
