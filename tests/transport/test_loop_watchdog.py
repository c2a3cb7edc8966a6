"""The event-loop watchdog catches a loop blocked by synchronous work, names what blocks it, and notes how
long the stall lasted once the loop turns again."""

from __future__ import annotations

import asyncio
import logging
import time

from worker.transport.loop_watchdog import LoopWatchdog
import pytest

pytestmark = pytest.mark.slow  # waits out a 1 s stall: in the full suite, not the fast subset


def block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # synchronous work on the loop: nothing else runs meanwhile


async def test_a_blocked_loop_is_reported_with_its_stack_and_its_length(caplog):
    watchdog = LoopWatchdog(stall_s=0.3, interval_s=0.05)
    task = asyncio.create_task(watchdog.run())
    try:
        await asyncio.sleep(0.2)
        assert watchdog.num_stalls == 0  # a turning loop is not a stall
        with caplog.at_level(logging.WARNING, logger="worker.transport.loop_watchdog"):
            block_the_loop_for(0.8)
            await asyncio.sleep(0.3)  # the loop turns again; the watchdog notices
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert watchdog.num_stalls == 1 and 0.6 <= watchdog.longest_stall_s <= 1.5
    messages = [r.getMessage() for r in caplog.records]
    assert any("event loop stalled" in m and "block_the_loop_for" in m for m in messages), messages
    assert any("turned again after a stall" in m for m in messages), messages
