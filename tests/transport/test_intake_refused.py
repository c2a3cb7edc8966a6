"""A read the broker refuses (an ACL withdrawn) in the middle of a poll: the records other partitions already
gave up are handled before the error reaches the worker, since their positions have moved past them."""

from __future__ import annotations

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from tests.transport.fakes import request_partition
from tests.transport.test_intake import KAFKA, build, send


def refuse(w, refused_partitions: set[int]) -> None:
    """getmany raises for the refused partitions, as aiokafka does once their fetch was refused."""
    getmany = w.consumer.getmany

    async def refusing(*partitions, **kwargs):
        if any(tp.partition in refused_partitions for tp in partitions):
            raise TopicAuthorizationFailedError(partitions[0].topic)
        return await getmany(*partitions, **kwargs)

    w.consumer.getmany = refusing


async def test_records_read_before_a_refused_partition_are_kept():
    w = build()
    tp_urgent, _ = send(w, 0, "urgent")
    tp_mid, _ = send(w, 1, "mid")
    refuse(w, {4, 5})  # priority 2's partitions: read after the other two priorities
    with pytest.raises(TopicAuthorizationFailedError):
        await w.intake.fetch_once()
    assert sorted(q.request.id for q in w.queue.take_where(lambda q: True)) == ["mid", "urgent"]
    assert w.tracker.next_offset(tp_urgent) == 1 and w.tracker.next_offset(tp_mid) == 1


async def test_records_read_before_a_refused_partition_of_the_same_priority_are_kept():
    w = build()
    request_id = next(f"urgent-{i}" for i in range(100) if request_partition(KAFKA, 0, f"urgent-{i}").partition == 0)
    send(w, 0, request_id)
    refuse(w, {1})  # read after partition 0, in the same getmany round of priority 0
    with pytest.raises(TopicAuthorizationFailedError):
        await w.intake.fetch_once()
    assert [q.request.id for q in w.queue.take_where(lambda q: True)] == [request_id]


async def test_a_refusal_with_nothing_read_is_raised_at_once_and_the_next_poll_is_clean():
    w = build()
    refuse(w, {0, 1, 2, 3, 4, 5})
    with pytest.raises(TopicAuthorizationFailedError):
        await w.intake.fetch_once()
    w.consumer.getmany = type(w.consumer).getmany.__get__(w.consumer)
    send(w, 1, "after")
    await w.intake.fetch_once()
    assert [q.request.id for q in w.queue.take_where(lambda q: True)] == ["after"]
