"""After start-up the worker moves what it built out of the garbage collector's generations (gc.freeze), so
full collections during steps no longer walk the model's and tokenizer's objects."""

from __future__ import annotations

import gc

from worker.engine.engine import freeze_startup_objects


def test_startup_objects_leave_the_collectors_generations_and_later_ones_do_not():
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000 and len(gc.get_objects()) < 100  # the collector no longer walks them
        later = [[i] for i in range(1000)]  # objects made after start-up are still tracked and collectable
        assert len(gc.get_objects()) >= len(later)
    finally:
        gc.unfreeze()
