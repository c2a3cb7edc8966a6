"""The commit watermark: lowest offset not yet done, whatever order requests finish in."""

from hypothesis import given
from hypothesis import strategies as st

from worker.transport.kafka.offsets import OffsetTracker


def test_watermark_waits_for_the_lowest_pending_offset():
    tracker = OffsetTracker()
    tracker.assign("p0", position=10)
    for offset in (10, 11, 12):
        assert tracker.track("p0", offset)
    assert tracker.to_commit() == {"p0": 10}
    tracker.done("p0", 12)
    tracker.done("p0", 11)
    assert tracker.watermark("p0") == 10
    tracker.done("p0", 10)
    assert tracker.watermark("p0") == 13


def test_nothing_consumed_commits_the_start_position_once():
    tracker = OffsetTracker()
    tracker.assign("p0", position=5, committed=5)
    assert tracker.to_commit() == {}
    tracker.assign("p1", position=0)
    assert tracker.to_commit() == {"p1": 0}
    tracker.committed({"p1": 0})
    assert tracker.to_commit() == {}


def test_gaps_in_offsets_are_skipped():
    # Compaction and transaction markers leave holes: the watermark must not wait for offsets never seen.
    tracker = OffsetTracker()
    tracker.assign("p", position=0)
    tracker.track("p", 3)
    tracker.track("p", 7)
    tracker.done("p", 7)
    assert tracker.watermark("p") == 3
    tracker.done("p", 3)
    assert tracker.watermark("p") == 8


def test_refetched_done_offset_is_not_tracked_again():
    tracker = OffsetTracker()
    tracker.assign("p", position=0)
    tracker.track("p", 0)
    tracker.track("p", 1)
    tracker.done("p", 1)
    assert not tracker.track("p", 1)
    assert not tracker.track("p", 0)  # still pending: a second copy must not be started
    assert tracker.watermark("p") == 0


def test_done_after_revoke_is_ignored_and_commit_only_moves_forward():
    tracker = OffsetTracker()
    tracker.assign("p", position=0)
    tracker.track("p", 0)
    tracker.revoke("p")
    assert tracker.done("p", 0) is False
    assert tracker.to_commit() == {}
    tracker.assign("q", position=4, committed=4)
    tracker.track("q", 4)
    tracker.done("q", 4)
    assert tracker.to_commit() == {"q": 5}
    tracker.committed({"q": 5})
    tracker.committed({"q": 3})  # a stale commit result must not move it back
    assert tracker.to_commit() == {}
    assert tracker.num_pending() == 0


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=60).map(
        lambda gaps: [sum(gaps[: i + 1]) + i for i in range(len(gaps))]
    ),
    st.randoms(use_true_random=False),
)
def test_watermark_is_lowest_undone_under_any_completion_order(offsets, rng):
    tracker = OffsetTracker()
    tracker.assign("p", position=offsets[0])
    for offset in offsets:
        tracker.track("p", offset)
    order = list(offsets)
    rng.shuffle(order)
    finished: set[int] = set()
    last_commit = -1
    for offset in order:
        assert tracker.done("p", offset)
        finished.add(offset)
        undone = [o for o in offsets if o not in finished]
        expected = undone[0] if undone else offsets[-1] + 1
        assert tracker.watermark("p") == expected
        # Never commit past an unfinished request, and never go backwards.
        commit = tracker.to_commit().get("p", last_commit)
        assert commit >= last_commit and all(o >= commit for o in undone)
        tracker.committed({"p": commit})
        last_commit = commit
    assert tracker.num_pending("p") == 0


def test_commit_progress_shows_how_long_commits_have_not_moved(monkeypatch):
    import worker.transport.kafka.offsets as offsets

    now = [1000.0]
    monkeypatch.setattr(offsets.time, "monotonic", lambda: now[0])
    t = OffsetTracker()
    t.assign("p0", position=10, committed=10)
    t.assign("p1", position=0)  # nothing committed yet: reading started at 0
    now[0] = 1100.0  # idle for 100 s: everything read is committed, nothing stalls
    assert t.commit_progress() == [("p0", 10, 10, 0.0), ("p1", 0, 0, 0.0)]
    t.track("p0", 10)  # the first record after the idle spell: its wait starts now, not at the last commit
    t.track("p0", 11)
    t.track("p1", 0)
    now[0] = 1130.0
    assert t.commit_progress() == [("p0", 10, 12, 30.0), ("p1", 0, 1, 30.0)]
    t.done("p0", 10)
    t.committed(t.to_commit())  # p0 moves to 11 (11 still pending); p1 commits 0, which is no progress
    now[0] = 1150.0
    assert t.commit_progress() == [("p0", 11, 12, 20.0), ("p1", 0, 1, 50.0)]
    t.done("p0", 11)
    t.committed(t.to_commit())
    assert t.commit_progress()[0] == ("p0", 12, 12, 0.0)


def test_commit_progress_is_on_the_metrics_endpoint():
    from aiokafka.structs import TopicPartition

    from worker.transport.metrics import WorkerMetrics

    metrics = WorkerMetrics.create()
    assert "commit_stalled_seconds{" not in metrics.exposition()  # no tracker yet: the families, no samples
    t = OffsetTracker()
    metrics.commits.source = t.commit_progress
    t.assign(TopicPartition("llm.requests", 3), position=5)
    t.track(TopicPartition("llm.requests", 3), 5)
    text = metrics.exposition()
    assert 'llm_worker:uncommitted_offsets{partition="3",topic="llm.requests"} 1.0' in text
    assert 'llm_worker:commit_stalled_seconds{partition="3",topic="llm.requests"}' in text
