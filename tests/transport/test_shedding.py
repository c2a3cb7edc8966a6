"""Shedding by estimated wait: least urgent first, never priority 0 for lag alone, with hysteresis."""

import pytest

from worker.transport.load.shedding import CompletionRate, Shedder


def rate_of(per_s: float) -> CompletionRate:
    rate = CompletionRate()
    rate.record(0, now=0.0)
    for i in range(1, 50):
        rate.record(int(per_s * 0.1), now=i * 0.1)
    return rate


def test_completion_rate_tracks_a_steady_rate_and_changes():
    rate = rate_of(100)
    assert rate.rate == pytest.approx(100, rel=0.05)
    for i in range(50, 250):
        rate.record(2, now=i * 0.1)  # 20/s
    assert rate.rate == pytest.approx(20, rel=0.1)
    rate.skip(now=100.0)  # an interval that does not count (the engine was not saturated)
    rate.record(1000, now=100.5)
    assert rate.rate > 20  # counted from the skip: 1000 in 0.5 s, folded in with its weight


def test_no_estimate_no_shedding():
    shedder = Shedder([10.0, 30.0, 60.0], num_priorities=3)
    decision = shedder.decide([10**6] * 3, [10**6] * 3, None)
    assert decision.shed_priorities == frozenset()


def test_least_urgent_shed_first_and_priority_zero_never():
    shedder = Shedder([1.0, 30.0, 60.0], num_priorities=3)
    # Capacity 10 tokens/s, requests of one token each: 10 requests/s.
    # p0 alone waits 100 s (> its 1 s limit) but is never shed; p2 waits behind p0+p1+p2 = 700 s.
    decision = shedder.decide([1000, 0, 0], [1000, 0, 0], 10.0)
    assert decision.shed_priorities == {1, 2}  # everything below waits behind p0's backlog too
    decision = shedder.decide([0, 200, 500], [0, 200, 500], 10.0)  # p1: 20 s < 30 s; p2: 70 s > 60 s
    assert decision.shed_priorities == {2}
    assert decision.est_wait_s[2] == pytest.approx(70, rel=0.05)
    assert "70" in decision.message(2) and "500" in decision.message(2)


def test_by_default_the_bulk_priority_waits_instead_of_being_shed():
    from worker.worker_settings import WorkerSettings

    shedder = Shedder(list(WorkerSettings().max_queue_time_s), num_priorities=3)
    # A backlog of an hour at every priority: priority 1 (bounded at 30 s) is shed, the bulk priority is not.
    decision = shedder.decide([0, 36_000, 36_000], [0, 36_000, 36_000], 10.0)
    assert decision.shed_priorities == {1}
    assert decision.est_wait_s[2] == pytest.approx(7200)  # still estimated and reported
    # A limit of 0 anywhere means no bound; a positive one still sheds.
    assert Shedder([10.0, 0.0, 5.0], 3).decide([0, 500, 100], [0, 500, 100], 10.0).shed_priorities == {2}


def test_hysteresis_keeps_shedding_until_well_below_the_limit():
    shedder = Shedder([10.0, 10.0, 10.0], num_priorities=3)
    assert shedder.decide([0, 0, 150], [0, 0, 150], 10.0).shed_priorities == {2}  # 15 s
    assert shedder.decide([0, 0, 90], [0, 0, 90], 10.0).shed_priorities == {2}  # 9 s: above 0.8 x 10
    assert shedder.decide([0, 0, 70], [0, 0, 70], 10.0).shed_priorities == frozenset()  # 7 s


def test_a_priority_not_read_yet_borrows_the_share_of_valid_records_seen_at_the_others():
    from worker.transport.load.shedding import ReachFraction

    reach = ReachFraction(3)
    assert reach.fractions() == [1.0, 1.0, 1.0]  # nothing seen: every unread record counts
    reach.observe(0, 100, 95)  # a flood of bad records, read most urgent first
    reach.observe(1, 100, 96)
    # Priority 2 has not been read yet: its unread records are judged like the others', not as all valid.
    assert reach.fraction(2) == pytest.approx(1.0 - 191 / 201, rel=1e-6)
    assert reach.fraction(0) < 0.1 and reach.fraction(1) < 0.1
    for _ in range(10):
        reach.observe(2, 100, 0)  # its own records turn out valid: its own share takes over
    assert reach.fraction(2) > 0.97


def test_a_first_lump_of_completions_does_not_read_as_many_times_the_rate():
    """A batch that finishes just after counting starts is 280 tokens in 0.05 s (5,600/s); the steady rate after
    it is 600/s. The capacity is only as good as this figure: read high, it hides a backlog."""
    rate = CompletionRate(half_life_s=5.0, min_seconds=1.0)
    rate.record(0, now=0.0)
    rate.record(280, now=0.05)
    assert rate.rate == 0.0  # not enough counted yet
    for i in range(2, 41):
        rate.record(30, now=i * 0.05)
    assert 600 <= rate.rate < 800
