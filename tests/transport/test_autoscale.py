"""The autoscaling signal (worker/transport/load/autoscale.py): workers needed from backlog, budgets, offered load
and capacity, and the offered load measured from tokens read and unread."""

import pytest

from schemas.decode import encode
from schemas.status import WorkerStatus
from worker.engine.api import EngineStats
from worker.transport.load.autoscale import TARGET_UTILIZATION, ArrivalRate, ScaleSignal, workers_needed
from worker.transport.load.load_control import LoadDecision
from worker.transport.metrics import WorkerMetrics
from worker.transport.load.shedding import ShedDecision
from worker.transport.status_report import LoadView, StatusReporter


def test_offered_load_alone_asks_for_headroom():
    # 800 tokens/s offered, 1000 tokens/s a worker, no backlog: 800 / 0.8 / 1000 = 1 worker.
    assert workers_needed([0, 0, 0], [10, 30, 60], 800.0, 1000.0, 1.0) == pytest.approx(1.0)
    assert workers_needed([0, 0, 0], [10, 30, 60], 4000.0, 1000.0, 1.0) == pytest.approx(5.0)


def test_backlog_must_drain_within_the_tightest_budget_it_waits_behind():
    # Priority 0: 5,000 tokens within 10 s = 500/s; priority 1 waits behind 0: 5,000 + 30,000 within 30 s
    # = 1,167/s, the binding one; priority 2: 35,000 + 6,000 within 60 s = 683/s.
    need = workers_needed([5_000, 30_000, 6_000], [10, 30, 60], 0.0, 1000.0, 1.0)
    assert need == pytest.approx(35_000 / 30 / 1000)
    # The same backlog with offered load on top: both add.
    with_load = workers_needed([5_000, 30_000, 6_000], [10, 30, 60], 400.0, 1000.0, 1.0)
    assert with_load == pytest.approx(need + 400 / TARGET_UTILIZATION / 1000)


def test_a_worker_scales_its_partitions_need_by_its_share():
    # A worker that owns a quarter of the partitions and needs 1.5 workers for them: the group needs 6.
    assert workers_needed([0], [10], 1200.0, 1000.0, 0.25) == pytest.approx(6.0)
    # The last budget covers the priorities past the list.
    assert workers_needed([0, 0, 6_000], [10, 30], 0.0, 1000.0, 1.0) == pytest.approx(6_000 / 30 / 1000)


def test_a_priority_without_a_bound_asks_for_no_drain_rate():
    """WORKER_MAX_QUEUE_TIME_S ships as [10, 30, 0]: 0 is no bound, not a 1 ms budget. 200 tokens waiting at
    priority 0 with 1,000 tokens/s a worker drain within 10 s at 20 tokens/s: 0.02 workers, not 200."""
    assert workers_needed([200, 0, 0], [10, 30, 0], 0.0, 1000.0, 1.0) == pytest.approx(0.02)
    assert workers_needed([200, 0, 0], [10, 30, 0], 0.0, 1000.0, 1.0) == workers_needed(
        [200, 0, 0], [10, 30, 1e9], 0.0, 1000.0, 1.0)
    # The unbounded priority's own backlog asks for nothing; what waits ahead of it still drains in time.
    assert workers_needed([0, 0, 50_000], [10, 30, 0], 0.0, 1000.0, 1.0) == 0.0
    assert workers_needed([0, 3_000, 50_000], [10, 30, 0], 0.0, 1000.0, 1.0) == pytest.approx(0.1)


def test_no_estimate_without_capacity_or_partitions():
    assert workers_needed([100], [10], 10.0, None, 1.0) is None
    assert workers_needed([100], [10], 10.0, 0.0, 1.0) is None
    assert workers_needed([100], [10], 10.0, 1000.0, 0.0) is None


def test_arrival_rate_counts_read_and_unread_tokens():
    rate = ArrivalRate(window_s=10.0)
    parts = frozenset({0, 1})
    assert rate.observe(0.0, 0.0, 0.0, parts) is None
    # 100 tokens/s arrive; the worker reads 60 of them, 40 a second pile up unread: the rate is 100.
    for t in range(1, 21):
        got = rate.observe(float(t), 60.0 * t, 40.0 * t, parts)
    assert got == pytest.approx(100.0)
    # The load halves: within one window the rate is the new one.
    for t in range(21, 32):
        got = rate.observe(float(t), 60.0 * 20 + 50.0 * (t - 20), 800.0, parts)
    assert got == pytest.approx(50.0)


def test_arrival_rate_restarts_with_a_new_assignment_and_the_signal_keeps_the_group_rate():
    signal = ScaleSignal(budgets_s=[10.0], num_partitions=4)
    half, all_four = frozenset({0, 1}), frozenset({0, 1, 2, 3})
    for t in range(0, 12):  # 400 tokens/s on half the partitions: the group sees 800/s
        need = signal.update(float(t), 0.0, 400.0 * t, [0.0], 1000.0, half)
    assert need == pytest.approx(800 / TARGET_UTILIZATION / 1000)
    # The other worker left: this one owns every partition, its unread tokens jump by the others' backlog.
    # The window restarts, and meanwhile the group's last rate stands in (no dip, no spike).
    need = signal.update(12.0, 5_000.0, 400.0 * 12, [5_000.0], 1000.0, all_four)
    assert need == pytest.approx(800 / TARGET_UTILIZATION / 1000 + 5_000 / 10 / 1000)


def _view(desired):
    shed = ShedDecision(frozenset(), [0.0], [0], [0.0])
    decision = LoadDecision([0], [0], shed, frozenset(), {}, True)
    return LoadView(decision, EngineStats(), [0], [[]], [0, 1], 0, 0, desired)


class _NoPublisher:
    pass


def test_the_status_record_and_the_gauge_carry_it():
    metrics = WorkerMetrics.create()
    reporter = StatusReporter(_NoPublisher(), metrics, "w1", "llm.status")
    status = reporter.build_status(_view(2.345678))
    assert status.desired_workers == pytest.approx(2.346)
    assert b'"desired_workers":2.346' in encode(status)
    reporter.update_metrics(_view(2.345678))
    assert "llm_worker:desired_workers 2.345678" in metrics.exposition()
    # No estimate: absent from the record, 0 on the gauge.
    assert reporter.build_status(_view(None)).desired_workers is None
    reporter.update_metrics(_view(None))
    assert "llm_worker:desired_workers 0.0" in metrics.exposition()
    assert WorkerStatus(worker_id="w", ts_ms=0).desired_workers is None
