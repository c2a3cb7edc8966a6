"""Out-of-order progress in the commit's metadata (progress.py, offsets.py, exactly_once.py).

The lanes here run against a fake transactional producer that keeps what a broker keeps: the records and the
offset (with its metadata) of each transaction, visible only once it commits. After every commit the test asks
what a new owner of the partition would do if this worker died right then (start at the committed offset, skip
what the metadata says is answered) and checks that every request read so far is answered exactly once: by a
visible final, or by the new owner, never both and never neither. Requests finish in a random order, and some
transactions fail and are written again."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from hypothesis import given, settings, strategies as st

from schemas.result import FinalRecord
from worker.transport.kafka import progress
from worker.transport.kafka.destinations import TopicState
from worker.transport.kafka.exactly_once import FinalLanes, Lane
from worker.transport.kafka.offsets import OffsetTracker

TP = TopicPartition("requests", 3)


# -- the encoding -----------------------------------------------------------------------------------------
@given(st.integers(0, 10**12), st.sets(st.integers(1, 5000), max_size=300))
@settings(max_examples=100, deadline=None)
def test_encode_decode_round_trip_and_size(committed, above):
    runs = progress.runs_of(committed + a for a in above)
    text = progress.encode(committed, runs)
    assert progress.decode(committed, text) == runs
    assert progress.offsets_of(progress.decode(committed, text)) == {committed + a for a in above}
    assert progress.encoded_size(committed, runs) == len(text.encode())


def test_metadata_of_another_offset_or_not_ours_is_ignored():
    text = progress.encode(100, [(102, 104)])
    assert progress.decode(100, text) == [(102, 104)]
    assert progress.decode(101, text) == []  # the offset was reset since: the record belongs to another
    for junk in ("", None, "hello", "llmw1@100:", "llmw1@100:x", "llmw1@100:1.-2", "llmw1@100:zzzzzz.zzzzzz"):
        assert progress.decode(100, junk) == [], junk


# -- the tracker --------------------------------------------------------------------------------------------
def test_progress_lists_answered_offsets_above_the_watermark():
    tracker = OffsetTracker()
    tracker.assign(TP, 10)
    for offset in range(10, 20):
        tracker.track(TP, offset)
    for offset in (12, 13, 15, 19):
        tracker.done(TP, offset)
    assert tracker.progress(TP) == (10, [(12, 13), (15, 15), (19, 19)])
    assert tracker.progress(TP, frozenset({10, 11})) == (14, [(15, 15), (19, 19)])
    tracker.done(TP, 10)
    tracker.done(TP, 11)
    assert tracker.progress(TP) == (14, [(15, 15), (19, 19)])


def test_a_new_owner_skips_what_the_last_one_answered_and_keeps_it_in_its_own_commits():
    tracker = OffsetTracker()
    tracker.assign(TP, 10, 10, [(12, 13), (16, 16)])
    assert tracker.progress(TP) == (10, [(12, 13), (16, 16)])
    assert [tracker.track(TP, offset) for offset in range(10, 18)] == [
        True, True, False, False, True, True, False, True]
    assert tracker.num_pending(TP) == 5
    tracker.done(TP, 10)
    tracker.done(TP, 11)
    assert tracker.progress(TP) == (14, [(16, 16)])
    for offset in (14, 15, 17):
        tracker.done(TP, offset)
    assert tracker.progress(TP) == (18, [])


def test_the_watermark_steps_over_answered_offsets_not_read_yet():
    tracker = OffsetTracker()
    tracker.assign(TP, 5, 5, [(5, 7), (9, 9)])  # a record right at the offset can be answered too
    assert tracker.progress(TP) == (8, [(9, 9)])


# -- the lanes against a transactional log -------------------------------------------------------------------
class TransactionalLog:
    """What the broker keeps of one partition's transactions: visible finals and the committed offset."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.visible: list[int] = []
        """Request offsets whose finals a read_committed consumer sees, in commit order."""
        self.committed: tuple[int, str] | None = None
        self.open_records: list[int] = []
        self.open_offsets = None
        self.on_commit = lambda: None
        self.metadata_sizes: list[int] = []
        self.num_aborted = 0


class FakeTransactionalProducer:
    def __init__(self, log: TransactionalLog) -> None:
        self.log = log

    async def begin_transaction(self):
        self.log.open_records, self.log.open_offsets = [], None

    async def send_offsets_to_transaction(self, offsets, group_id):
        assert group_id == self.log.group
        ((tp, (offset, metadata)),) = offsets.items()
        assert tp == TP
        self.log.open_offsets = (offset, metadata)

    async def commit_transaction(self):
        self.log.visible += self.log.open_records
        if self.log.open_offsets is not None:
            self.log.committed = self.log.open_offsets
            self.log.metadata_sizes.append(len(self.log.open_offsets[1].encode()))
        self.log.open_records, self.log.open_offsets = [], None
        self.log.on_commit()

    async def abort_transaction(self):
        self.log.open_records, self.log.open_offsets = [], None
        self.log.num_aborted += 1


def fake_publisher():
    return SimpleNamespace(
        has_unsettled=lambda key: False, headers_for=None, send_wait_s=5.0,
        destinations=SimpleNamespace(state=lambda topic: TopicState(True, time.monotonic())))


def final_of(offset: int):
    request_id = f"r{offset}"
    final = FinalRecord(id=request_id, status="completed", reason="length", finish_reason="length")
    return [("results", request_id.encode(), str(offset).encode(), final)]


def redone_by_a_new_owner(log: TransactionalLog, read_up_to: int) -> set[int]:
    """The offsets below read_up_to that a new owner would answer if this worker died now."""
    if log.committed is None:
        return set(range(read_up_to))
    offset, metadata = log.committed
    return set(range(offset, read_up_to)) - progress.offsets_of(progress.decode(offset, metadata))


def check_exactly_once(log: TransactionalLog, read_up_to: int) -> None:
    visible = log.visible
    assert len(visible) == len(set(visible)), "a final written twice"
    redone = redone_by_a_new_owner(log, read_up_to)
    both = redone & set(visible)
    neither = set(range(read_up_to)) - redone - set(visible)
    assert not both, f"answered twice after a crash now: {sorted(both)}"
    assert not neither, f"never answered after a crash now: {sorted(neither)}"


async def run_lane(lanes: FinalLanes, lane: Lane, body) -> None:
    lane.task = asyncio.create_task(lanes._run(lane))
    try:
        await body()
    finally:
        lane.task.cancel()
        await asyncio.gather(lane.task, return_exceptions=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
async def test_out_of_order_finals_are_answered_once_whenever_the_worker_dies(seed):
    rng = random.Random(seed)
    tracker = OffsetTracker()
    tracker.assign(TP, 0)
    log = TransactionalLog("group")
    lanes = FinalLanes({}, "group", tracker, fake_publisher(), lambda *args: None, interval_s=0.005)
    checks = []
    log.on_commit = lambda: (check_exactly_once(log, tracker.next_offset(TP)), checks.append(1))

    async def send_all(producer, records, headers_for=None, progress_partition=0, progress_records=()):
        if rng.random() < 0.1:
            raise KafkaError("the broker went away mid-transaction")
        log.open_records += [int(value) for _, _, value in records]

    lanes._send_all = send_all
    lane = Lane(TP, producer=FakeTransactionalProducer(log))
    lanes._lanes[TP] = lane
    num = 300

    async def body():
        finishing: list[int] = []
        for offset in range(num):
            assert tracker.track(TP, offset)
            finishing.append(offset)
            # A batch of running requests: any of them may finish next, not the oldest.
            while finishing and (len(finishing) > 24 or rng.random() < 0.5):
                done = finishing.pop(rng.randrange(len(finishing)))
                lanes.add(TP, done, final_of(done))
                if rng.random() < 0.3:
                    await asyncio.sleep(0.006)
        for done in rng.sample(finishing, len(finishing)):
            lanes.add(TP, done, final_of(done))
        async with asyncio.timeout(20):
            while len(log.visible) < num or tracker.progress(TP)[0] < num:
                await asyncio.sleep(0.01)

    await run_lane(lanes, lane, body)
    assert sorted(log.visible) == list(range(num))
    assert log.committed[0] == num
    assert lanes.num_aborted > 0 and len(checks) > 10
    out_of_order = [size for size in log.metadata_sizes if size > len(progress.encode(0, []))]
    assert out_of_order, "no commit carried answered offsets above its watermark: the test proved nothing"


async def test_a_full_progress_record_holds_answers_back_and_stops_reading_until_the_watermark_moves():
    tracker = OffsetTracker()
    tracker.assign(TP, 1000)
    log = TransactionalLog("group")
    limit = 64
    lanes = FinalLanes({}, "group", tracker, fake_publisher(), lambda *args: None, interval_s=0.005,
                       max_metadata_bytes=limit)
    log.on_commit = lambda: check_exactly_once_from(log, 1000, tracker.next_offset(TP))

    async def send_all(producer, records, headers_for=None, progress_partition=0, progress_records=()):
        log.open_records += [int(value) for _, _, value in records]

    lanes._send_all = send_all
    lane = Lane(TP, producer=FakeTransactionalProducer(log))
    lanes._lanes[TP] = lane

    async def body():
        for offset in range(1000, 1040):
            tracker.track(TP, offset)
        # Every other request above the first finishes: each is a run of its own in the record.
        for offset in range(1001, 1040, 2):
            lanes.add(TP, offset, final_of(offset))
        async with asyncio.timeout(5):
            while not tracker.progress_full(TP, limit):
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert len(log.visible) < 20, "every answer was committed: the limit was never reached"
        assert max(log.metadata_sizes) <= limit
        # The request at the watermark finishes, then the rest: everything is written and reading resumes.
        for offset in range(1000, 1040, 2):
            lanes.add(TP, offset, final_of(offset))
        async with asyncio.timeout(5):
            while len(log.visible) < 40 or tracker.progress_full(TP, limit):
                await asyncio.sleep(0.005)

    await run_lane(lanes, lane, body)
    assert sorted(log.visible) == list(range(1000, 1040))
    assert max(log.metadata_sizes) <= limit
    assert log.committed == (1040, progress.encode(1040, []))
    assert lanes.num_progress_full > 0


def check_exactly_once_from(log: TransactionalLog, start: int, read_up_to: int) -> None:
    offset, metadata = log.committed
    redone = set(range(offset, read_up_to)) - progress.offsets_of(progress.decode(offset, metadata))
    visible = set(log.visible)
    assert len(log.visible) == len(visible)
    assert not redone & visible
    assert not set(range(start, read_up_to)) - redone - visible


def test_the_finals_of_a_requests_completions_go_in_its_own_transaction():
    """n > 1: each completion's final waits for the request's final, so that all of them commit with its offset.
    Written on their own, they would be committed while the request's offset is not, and the partition's next
    owner would answer the request, completions included, a second time."""
    from tests.transport.fakes import tenant_book
    from worker.transport.metrics import WorkerMetrics
    from worker.transport.requests.answers import Answers

    added: list[tuple[int | None, list[bytes]]] = []
    lanes = SimpleNamespace(add=lambda tp, offset, records: added.append((offset, [r[2] for r in records])))
    answers = Answers(SimpleNamespace(), OffsetTracker(), WorkerMetrics.create(), "w", "results", "dlq",
                      usage_topic="usage", lanes=lanes, tenants=tenant_book())

    def final(request_id: str, index: int | None) -> FinalRecord:
        return FinalRecord(id=request_id, status="completed", reason="length", finish_reason="length", index=index)

    answers.final(TP, None, "results", final("a", 0))
    answers.final(TP, None, "results", final("b", 1))
    answers.final(TP, None, "results", final("a", 1))
    assert added == [] and answers.num_held_completions == 2
    answers.final(TP, 7, "results", final("a", None))
    ((offset, values),) = added
    assert offset == 7 and len(values) == 4  # a's two completions, its own final, its usage record
    assert answers.num_held_completions == 1
    answers.forget({TP})  # the partition went elsewhere: b is answered by its next owner
    assert answers.num_held_completions == 0


async def test_a_lane_that_is_no_longer_the_members_does_not_replace_its_producer():
    """A zombie wakes with its transaction 'stuck': starting a new producer would fence the partition's new
    owner and commit stale answers. Asked whether it is still the member that owned the partition and told no,
    the lane counts as fenced and writes nothing more."""
    from worker.transport.kafka.exactly_once import LaneStuck

    tracker = OffsetTracker()
    tracker.assign(TP, 0)
    tracker.track(TP, 0)
    log = TransactionalLog("group")
    asked = []

    async def still_member() -> bool:
        asked.append(1)
        return False

    lanes = FinalLanes({}, "group", tracker, fake_publisher(), lambda *args: None, interval_s=0.005,
                       still_member=still_member)

    async def send_all(producer, records, headers_for=None, progress_partition=0, progress_records=()):
        raise LaneStuck("records not acknowledged within 5 s")

    async def never(lane):
        raise AssertionError("a zombie's lane started a new producer")

    lanes._send_all = send_all
    lanes._replace_producer = never
    lane = Lane(TP, producer=FakeTransactionalProducer(log))
    lanes._lanes[TP] = lane

    async def body():
        lanes.add(TP, 0, final_of(0))
        async with asyncio.timeout(5):
            while not lane.fenced:
                await asyncio.sleep(0.01)

    await run_lane(lanes, lane, body)
    assert asked and lane.fenced and log.visible == [] and lanes.fenced() == {TP}


async def test_the_commit_points_at_the_latest_full_round_of_progress_records():
    """Progress records ride in the lane's transactions: the committed metadata points at the first record of the
    latest full round, a previous owner's point is kept until this lane writes a round of its own, and a round
    with nothing to resume clears it."""
    tracker = OffsetTracker()
    tracker.assign(TP, 0)
    log = TransactionalLog("group")
    running: dict[bytes, bytes] = {b"r1": b"p1", b"r2": b"p2"}
    asked: list[bool] = []

    def source(tp, full):
        asked.append(full)
        return sorted(running.items()) if full else []

    lanes = FinalLanes({}, "group", tracker, fake_publisher(), lambda *args: None, interval_s=0.005,
                       progress_topic="progress", progress_source=source, progress_interval_s=0.05)
    written: list[bytes] = []  # the progress partition: a record's offset is its index

    async def send_all(producer, records, headers_for=None, progress_partition=0, progress_records=()):
        assert progress_partition == TP.partition
        log.open_records += [int(value) for _, _, value in records]
        first = len(written)
        written.extend(value for _, value in progress_records)
        return first if progress_records else None

    lanes._send_all = send_all
    lane = Lane(TP, producer=FakeTransactionalProducer(log))
    lanes._lanes[TP] = lane
    lanes.keep_resume_point(TP, 1234)  # the previous owner's round
    assert tracker.track(TP, 0) and tracker.track(TP, 1)

    def point() -> int | None:
        return None if log.committed is None else progress.resume_pointer(*log.committed)

    async def body():
        lanes.add(TP, 1, final_of(1))  # answered above the watermark: a commit with metadata
        async with asyncio.timeout(5):
            while point() in (None, 1234):
                await asyncio.sleep(0.005)
        first_round = point()
        assert written[first_round:first_round + 2] == [b"p1", b"p2"]
        # A round that would repeat the last one is not written; once the requests move on, the next is, and the
        # point follows it.
        await asyncio.sleep(0.3)
        assert point() == first_round
        running[b"r2"] = b"p2 moved on"
        async with asyncio.timeout(5):
            while point() == first_round:
                await asyncio.sleep(0.01)
        assert point() > first_round and written[point():point() + 2] == [b"p1", b"p2 moved on"]
        # Between rounds a transaction that answers something also asks for the records of requests with none.
        asked.clear()
        lanes.add(TP, 0, final_of(0))
        async with asyncio.timeout(5):
            while 0 not in log.visible:
                await asyncio.sleep(0.005)
        running.clear()  # nothing left to resume: the point goes
        async with asyncio.timeout(5):
            while point() is not None:
                await asyncio.sleep(0.005)

    await run_lane(lanes, lane, body)
    assert True in asked and False in asked  # full rounds, and the requests without a record in between
    assert lanes.num_progress_records >= 4
