"""A final lane against fake clients: a transaction that fails after some of its answers were held back (their
chunks not yet settled) writes each answer once in the transactions that follow, never twice."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from schemas.result import FinalRecord
from worker.transport.kafka.destinations import TopicState
from worker.transport.kafka.exactly_once import FinalLanes, Lane
from worker.transport.kafka.offsets import OffsetTracker

TP = TopicPartition("requests", 1)


class FakeProducer:
    async def begin_transaction(self):
        pass

    async def commit_transaction(self):
        pass

    async def abort_transaction(self):
        pass

    async def send_offsets_to_transaction(self, offsets, group_id):
        pass


def answer(request_id: str):
    final = FinalRecord(id=request_id, status="completed", reason="length", finish_reason="length")
    return (None, [("results", request_id.encode(), b"{}", final)])


async def test_answers_held_back_by_a_failed_transaction_are_written_once():
    unsettled = {b"held"}
    publisher = SimpleNamespace(
        has_unsettled=lambda key: key in unsettled, headers_for=None, send_wait_s=5.0,
        destinations=SimpleNamespace(state=lambda topic: TopicState(True, time.monotonic())))
    lanes = FinalLanes({}, "group", OffsetTracker(), publisher, lambda *args: None, interval_s=0.02)
    written: list[list[bytes]] = []

    async def send_all(producer, records, headers_for=None, progress_partition=0, progress_records=()):
        if not written:
            written.append([])
            unsettled.clear()  # the held answer's chunks settle meanwhile
            raise KafkaError("the broker went away mid-transaction")
        written.append([key for _, key, _ in records])

    lanes._send_all = send_all
    lane = Lane(TP, producer=FakeProducer())
    lanes._lanes[TP] = lane
    lane.task = asyncio.create_task(lanes._run(lane))
    try:
        for request_id in ("sent", "held"):
            lanes.add(TP, None, answer(request_id)[1])
        async with asyncio.timeout(5):
            while sorted(key for keys in written[1:] for key in keys) != [b"held", b"sent"] or lane.pending:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # a duplicate would be written within a few intervals
    finally:
        lane.task.cancel()
        await asyncio.gather(lane.task, return_exceptions=True)
    assert sorted(key for keys in written[1:] for key in keys) == [b"held", b"sent"], written
