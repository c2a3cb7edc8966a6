"""The structured-output manager's wake time while requests wait for their grammars: a fixed time that comes
due, not one that moves away each time it is asked (an engine thread that waited for it and asked again would
never step, and requests whose grammars had compiled stayed held for good)."""

from __future__ import annotations

from concurrent.futures import Future

from worker.model.structured.compile import GrammarLimits
from worker.model.structured.manager import GRAMMAR_POLL_S, StructuredOutputManager, _Held


def test_the_wake_time_of_held_requests_comes_due_and_a_step_renews_it():
    manager = StructuredOutputManager(None, 10, (0,), GrammarLimits())
    assert manager.wake_time(100.0) is None  # nothing held
    manager._held["r"] = _Held("r", object(), Future())
    due = manager.wake_time(100.0)
    assert due == 100.0 + GRAMMAR_POLL_S
    assert manager.wake_time(100.0 + GRAMMAR_POLL_S / 2) == due  # asked again while waiting: the same time
    assert manager.wake_time(due + 1.0) == due  # past it: due now
    manager._poll_at = None  # what take_ready does when a step looks
    assert manager.wake_time(200.0) == 200.0 + GRAMMAR_POLL_S
