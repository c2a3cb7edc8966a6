"""Pause/resume decisions: queue pressure per priority (counting only more urgent work), KV pressure least
urgent first one level per dwell period, hysteresis between watermarks."""

from worker.worker_settings import WorkerSettings
from worker.transport.load.backpressure import Backpressure, LoadSnapshot


def make(**overrides) -> Backpressure:
    settings = dict(max_waiting=100, resume_waiting=50, kv_pause_threshold=0.9, kv_resume_threshold=0.7,
                    priority_backlog_threshold=1000, pause_dwell_s=0.5)
    settings.update(overrides)
    return Backpressure.from_settings(WorkerSettings(**settings), num_priorities=3)


def load(waiting=(0, 0, 0), kv=0.0, backlog=(0, 0, 0)) -> LoadSnapshot:
    return LoadSnapshot(waiting_by_priority=list(waiting), kv_usage=kv, backlog_by_priority=list(backlog))


def test_queue_pressure_pauses_a_priority_only_for_work_as_urgent_or_more():
    bp = make()
    assert bp.decide(load((0, 0, 101)), now=0.0).paused_priorities == {2}
    # A queue full of priority-1 work pauses priorities 1 and 2, never the urgent one.
    assert bp.decide(load((0, 120, 30)), now=1.0).paused_priorities == {1, 2}
    decision = bp.decide(load((101, 0, 0)), now=2.0)
    assert decision.paused_priorities == {0, 1, 2}
    assert decision.reasons == {0: "queue", 1: "queue", 2: "queue"}


def test_hysteresis_holds_between_watermarks_then_resumes():
    bp = make()
    bp.decide(load((0, 150, 50)), now=0.0)
    assert bp.decide(load((0, 75, 0)), now=1.0).paused_priorities == {1, 2}  # between 50 and 100: hold
    assert bp.decide(load((0, 40, 20)), now=2.0).paused_priorities == {2}  # p1: 40 < 50; p2: 60 holds
    assert bp.decide(load((0, 40, 20)), now=2.3).paused_priorities == {2}
    assert bp.decide(load((0, 10, 10)), now=3.0).paused_priorities == set()


def test_kv_pressure_pauses_with_its_reason_and_needs_both_signals_low_to_resume():
    bp = make()
    decision = bp.decide(load(kv=0.95), now=0.0)
    assert decision.reasons == {2: "kv"}
    assert bp.decide(load(kv=0.95), now=0.6).reasons == {1: "kv", 2: "kv"}  # one more level per dwell
    assert bp.decide(load(kv=0.8), now=1.2).paused_priorities == {1, 2}  # between the watermarks: hold
    assert bp.decide(load(kv=0.5), now=2.0).paused_priorities == {2}  # below: one level per dwell
    assert bp.decide(load(kv=0.5), now=3.0).paused_priorities == set()


def test_urgent_backlog_pauses_every_less_urgent_priority_until_it_halves():
    bp = make(priority_backlog_threshold=10)
    decision = bp.decide(load(backlog=(11, 0, 500)), now=0.0)
    assert decision.paused_priorities == {1, 2}
    assert decision.reasons == {1: "priority_backlog", 2: "priority_backlog"}
    assert bp.decide(load(backlog=(8, 0, 500)), now=1.0).paused_priorities == {1, 2}  # 8 > 10 // 2
    assert bp.decide(load(backlog=(5, 20, 500)), now=2.0).paused_priorities == {2}  # p1's own backlog
    assert bp.decide(load(backlog=(0, 0, 500)), now=3.0).paused_priorities == set()


def test_no_churn_faster_than_dwell():
    bp = make(priority_backlog_threshold=10)
    states = []
    for i in range(20):
        backlog = (50, 0, 0) if i % 2 == 0 else (0, 0, 0)
        states.append((i * 0.1, bp.decide(load(backlog=backlog), now=i * 0.1).paused_priorities))
    changes = [t for (t, s), (_, prev) in zip(states[1:], states[:-1]) if s != prev]
    assert changes, "expected at least one change"
    assert all(b - a >= 0.5 - 1e-9 for a, b in zip(changes, changes[1:]))


def test_a_less_urgent_priority_never_reads_while_a_more_urgent_one_is_paused():
    """Per-priority dwell clocks once let priority 2 resume while priority 1, paused later, still waited out its
    dwell (seen in CI as a status with partitions of priority 1 paused and those of priority 2 not)."""
    bp = make()
    assert bp.decide(load((0, 0, 101)), now=0.0).paused_priorities == {2}
    assert bp.decide(load((0, 101, 0)), now=0.2).paused_priorities == {1, 2}
    # At 0.6 the queue is empty: priority 2's dwell has passed, priority 1's has not. Both stay paused.
    assert bp.decide(load(), now=0.6).paused_priorities == {1, 2}
    assert bp.decide(load(), now=0.8).paused_priorities == set()
    # Priority 2 just resumed (inside its dwell) and priority 1 pauses again: priority 2 pauses with it.
    bp = make()
    bp.decide(load((0, 0, 101)), now=0.0)
    assert bp.decide(load(), now=0.6).paused_priorities == set()
    assert bp.decide(load((0, 101, 0)), now=0.7).paused_priorities == {1, 2}


def test_backlog_pauses_keep_the_same_order_through_dwell():
    bp = make(priority_backlog_threshold=10)
    assert bp.decide(load(backlog=(0, 11, 0)), now=0.0).paused_priorities == {2}
    assert bp.decide(load(backlog=(11, 0, 0)), now=0.2).paused_priorities == {1, 2}
    assert bp.decide(load(), now=0.6).paused_priorities == {1, 2}  # 2's dwell passed, 1's not: wait for 1
    assert bp.decide(load(), now=0.8).paused_priorities == set()
