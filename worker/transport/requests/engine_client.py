"""What the transport drives the engine through, whichever side of a process boundary it runs on, and the one
factory that makes it (as vLLM's EngineCoreClient.make_client).

- in process: an `EngineThread` around the engine (engine_thread.py): the engine steps on its own thread;
- engine process (`WORKER_ENGINE_PROCESS=true`): the `EngineProcess` serve.py spawned (engine_process.py):
  the engine steps in a child process, and the client relays commands and outputs over a pipe.

Both put each list of outputs on the worker's asyncio queue and keep the engine's latest stats.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from worker.engine.api import Engine, EngineRequest, EngineStats
from worker.transport.requests.engine_process import EngineProcess
from worker.transport.requests.engine_thread import EngineThread


class EngineClient(Protocol):
    def start(self) -> None: ...

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def set_input_ended(self, ended: bool) -> None: ...

    def stop(self, timeout: float | None = 10.0) -> None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def stats(self) -> EngineStats:
        """The engine's latest stats (a snapshot the engine side replaces after each step)."""


def make_engine_client(engine: Engine | EngineProcess, loop: asyncio.AbstractEventLoop,
                       outputs: asyncio.Queue) -> EngineClient:
    """The client for what serve.py (or a test) built: an engine in this process, or an engine process."""
    if isinstance(engine, EngineProcess):
        return engine.attach(loop, outputs)
    return EngineThread(engine, loop, outputs)
