"""A watchdog for the worker's event loop: a thread that notices when the loop stops turning.

A coroutine on the loop stamps a heartbeat every `interval_s`; a daemon thread checks the stamp. When the loop
has not turned for `stall_s`, the thread logs a warning with the loop thread's current Python stack (taken
from another thread, so the stall itself is caught in the act), and when the loop turns again, how long it
stood still. A stalled loop sends no heartbeats to Kafka, fetches nothing and publishes nothing; near the
group's session timeout it costs a rebalance. The count and the longest stall are kept for the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(self, stall_s: float = 2.0, interval_s: float = 0.1) -> None:
        self.stall_s = stall_s
        self.interval_s = interval_s
        self.num_stalls = 0
        self.longest_stall_s = 0.0
        self._beat = time.monotonic()
        self._loop_thread_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def run(self) -> None:
        """The heartbeat; runs on the loop being watched until cancelled. Starts the watching thread."""
        self._loop_thread_id = threading.get_ident()
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        try:
            while True:
                self._beat = time.monotonic()
                await asyncio.sleep(self.interval_s)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        stalled_since: float | None = None
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            idle = time.monotonic() - beat
            if stalled_since is None and idle >= self.stall_s:
                stalled_since = beat
                self.num_stalls += 1
                log.warning("event loop stalled for %.1fs so far; it is running:\n%s", idle, self._loop_stack())
            elif stalled_since is not None and beat > stalled_since:
                length = beat - stalled_since
                self.longest_stall_s = max(self.longest_stall_s, length)
                log.warning("event loop turned again after a stall of %.1fs", length)
                stalled_since = None

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread_id) if self._loop_thread_id is not None else None
        if frame is None:
            return "  (no frame: the loop's thread is not running Python)"
        return "".join(traceback.format_stack(frame)[-12:])
