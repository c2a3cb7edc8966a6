"""After start-up the worker moves what it built out of the garbage collector's generations (gc.freeze), so
full collections during steps no longer walk the model's and tokenizer's objects."""

from __future__ import annotations

import pytest

import gc
from collections import deque

from worker.memory import freeze_startup_objects


def test_startup_objects_leave_the_collectors_generations_and_later_ones_do_not():
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000 and len(gc.get_objects()) < 100  # the collector no longer walks them
        later = [[i] for i in range(1000)]  # objects made after start-up are still tracked and collectable
        assert len(gc.get_objects()) >= len(later)
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_garbage_cycles_made_after_the_freeze_do_not_wait_for_a_quarter_of_the_frozen_heap():
    """Cycles that outlive the young generations (a request's state held for a while, then dropped) reach the
    oldest one; a full collection must come for them at the usual pace (every tenth collection of the middle
    generation), not once a quarter of the frozen start-up heap has been promoted after them."""
    startup = [[i] for i in range(1_000_000)]  # the model's, tokenizer's and modules' objects
    held: deque[dict] = deque(maxlen=10_000)
    full: list[int] = []

    def count_full(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info["collected"])

    try:
        freeze_startup_objects()
        gc.callbacks.append(count_full)
        for _ in range(150_000):  # about two full collections' worth at CPython's pace
            state: dict = {}
            state["self"] = state
            held.append(state)
        assert full and sum(full) > 50_000, f"full collections after the freeze: {full}"
    finally:
        if count_full in gc.callbacks:
            gc.callbacks.remove(count_full)
        gc.unfreeze()
        del startup
