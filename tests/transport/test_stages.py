"""The request stages: the one table that knows whether a request has ended refuses a second answer."""

from __future__ import annotations

from worker.transport.requests.stages import RequestBook, Stage
from tests.transport.test_streamer import queued


def test_a_request_is_answered_once_and_a_given_up_one_not_at_all():
    seen = []
    book = RequestBook(on_violation=lambda: seen.append(1))
    a, b = queued("a", 0), queued("b", 0)
    for q in (a, b):
        book.read(q)
        book.move(q, Stage.QUEUED)
    book.move(a, Stage.IN_ENGINE)
    assert book.by_stage() == {"read": 0, "queued": 1, "held": 0, "in_engine": 1} and len(book) == 2
    assert book.answered(a) and a.stage is Stage.ANSWERED
    assert not book.answered(a)  # a second final for the same read of the record is refused
    book.move(b, Stage.HELD)
    assert not book.answered(b)  # its partition is not this worker's to answer for until the assignment
    book.given_up(b)
    book.given_up(b)  # each completion of a request may be given up: once counts
    assert not book.answered(b)  # the next owner answers it
    assert len(book) == 0 and (book.num_answered, book.num_given_up) == (1, 1)
    assert len(book.violations) == 3 and len(seen) == 3


def test_moves_outside_the_drawing_are_violations_but_go_through():
    book = RequestBook()
    a = queued("a", 0)
    book.read(a)
    book.move(a, Stage.IN_ENGINE)  # never queued
    assert a.stage is Stage.IN_ENGINE and book.violations == [f"request {a.engine_id}: read -> in_engine"]
