"""The overload benchmark's arithmetic on hand-made records: outcomes, the per-priority table, goodput, wasted
tokens, predicted vs actual, capacity, time series and floors."""

import dataclasses

import pytest

from benchmarks.lib.overload_stats import (
    FinalSeen, RequestLog, StatusSample, capacity_from_completions, check_floors, engine_summary, goodput, outcome,
    phase_summary, prediction_errors, priority_table, time_series, wasted_tokens,
)


def _final(at_s: float, status: str = "completed", reason: str = "length", tokens: int = 8, attempt: int = 0,
           **fields) -> FinalSeen:
    return FinalSeen(attempt, status, reason, at_s, tokens, **fields)


def _req(rid: str, priority: int, arrival_s: float, timeout_s: float | None, *finals: FinalSeen,
         backoff_s: float = 0.0) -> RequestLog:
    return RequestLog(rid, priority, arrival_s, timeout_s, backoff_s, finals=list(finals))


def _mixed() -> list[RequestLog]:
    return [
        _req("a", 0, 0.0, 10.0, _final(4.0)),                                    # in time
        _req("b", 0, 1.0, 10.0, _final(11.5)),                                   # late: 11.5 > 1 + 10
        _req("c", 1, 2.0, 20.0, _final(2.1, "rejected", "shed", tokens=0)),
        _req("d", 2, 3.0, 30.0, _final(33.0, "rejected", "deadline", tokens=3)),  # stopped while running
        _req("e", 2, 4.0, 30.0),                                                 # no final
        _req("f", 1, 5.0, 20.0, _final(5.2, "error", "invalid_request", tokens=0)),
    ]


def test_outcome_classes_and_the_deadline_counts_from_the_submit_call():
    assert [outcome(r) for r in _mixed()] == [
        "completed_in_time", "completed_late", "rejected:shed", "rejected:deadline", "missing",
        "error:invalid_request"]
    assert outcome(_req("x", 0, 0.0, None, _final(500.0))) == "completed_in_time"  # no deadline
    assert outcome(_req("y", 0, 2.0, 10.0, _final(12.0))) == "completed_in_time"  # exactly at the deadline
    failed = _req("z", 0, 0.0, 10.0)
    failed.send_error = "KafkaTimeoutError"
    assert outcome(failed) == "error:send_failed"


def test_the_highest_attempt_is_the_answer_and_duplicates_are_counted_apart_from_redeliveries():
    dup = _req("d", 0, 0.0, 10.0, _final(1.0), _final(1.5))
    assert dup.num_duplicate_finals == 1 and dup.num_extra_attempts == 0 and dup.final.at_s == 1.0
    redelivered = _req("r", 0, 0.0, 10.0, _final(1.0, "rejected", "deadline", attempt=3), _final(2.0, attempt=5),
                       _final(2.5, attempt=5))
    assert redelivered.final.attempt == 5 and outcome(redelivered) == "completed_in_time"
    assert redelivered.num_extra_attempts == 1 and redelivered.num_duplicate_finals == 1
    summary = phase_summary([dup, redelivered, _req("ok", 0, 0.0, 10.0, _final(1.0))], 10.0, 1.0)
    assert summary["num_duplicate_finals"] == 2 and summary["num_redelivered"] == 1
    assert summary["duplicate_ids"] == ["d", "r"]


def test_priority_table_counts_and_e2e_percentiles_of_completed_only():
    table = priority_table(_mixed() + [_req("g", 0, 2.0, 10.0, _final(4.0))])
    p0, p2, every = table["0"], table["2"], table["all"]
    assert (p0["sent"], p0["completed"], p0["completed_in_time"], p0["completed_late"]) == (3, 3, 2, 1)
    assert p0["in_time_fraction"] == pytest.approx(2 / 3)
    assert p0["e2e_s"]["p50"] == pytest.approx(4.0)  # e2e of a, b, g: 4, 10.5, 2
    assert p0["e2e_s"]["p99"] == pytest.approx(4.0 + (10.5 - 4.0) * 0.98)
    assert (p2["missing"], p2["rejected"], p2["e2e_s"]["p50"]) == (1, {"deadline": 1}, None)
    assert every["rejected"] == {"deadline": 1, "shed": 1} and every["error"] == {"invalid_request": 1}
    assert list(table) == ["0", "1", "2", "all"] and every["sent"] == 7


def test_goodput_counts_in_time_completions_from_the_first_completion_to_the_end_of_arrivals():
    reqs = _mixed() + [_req("g", 1, 2.0, 20.0, _final(6.0)), _req("h", 2, 2.0, 30.0, _final(25.0))]
    # Completed: a at 4 (in time), b at 11.5 (late), g at 6, h at 25 (after the window, in time).
    gp = goodput(reqs, 12.0)
    assert gp["first_completion_s"] == 4.0 and gp["span_s"] == 8.0
    assert gp["per_s"] == pytest.approx(2 / 8)  # a and g; b is late, h came in the drain
    assert gp["incl_drain_per_s"] == pytest.approx(3 / 12)
    summary = phase_summary(reqs, 12.0, capacity=0.5)
    assert summary["goodput_over_capacity"] == pytest.approx(0.5)
    assert summary["num_missing"] == 1
    assert goodput([_req("x", 0, 0.0, 1.0)], 10.0)["per_s"] is None  # nothing completed


def test_the_first_message_of_each_refusal_kind_is_kept():
    reqs = [_req("a", 0, 0.0, 10.0, _final(0.1, "rejected", "deadline", message="estimate 12 s > 10 s")),
            _req("b", 0, 0.0, 10.0, _final(0.2, "rejected", "deadline", message="other")),
            _req("c", 2, 0.0, 10.0, _final(0.2, "rejected", "shed")), _req("d", 0, 0.0, 10.0, _final(1.0))]
    assert phase_summary(reqs, 10.0, 1.0)["message_examples"] == {
        "p0 rejected:deadline": "estimate 12 s > 10 s", "p2 rejected:shed": ""}


def test_wasted_tokens_are_late_rejected_and_superseded_work_and_a_repeated_final_counts_once():
    w = wasted_tokens(_mixed())
    assert (w["total"], w["wasted"]) == (8 + 8 + 3, 8 + 3)
    redelivered = _req("r", 0, 0.0, 10.0, _final(1.0, "rejected", "deadline", tokens=5, attempt=1),
                       _final(2.0, attempt=2), _final(2.1, attempt=2))
    w = wasted_tokens([redelivered])
    assert (w["total"], w["wasted"], w["fraction"]) == (13, 5, pytest.approx(5 / 13))
    assert wasted_tokens([])["fraction"] is None


def test_prompt_tokens_computed_for_requests_that_missed_their_deadline_are_counted_beside():
    reqs = [
        _req("kept", 0, 0.0, 10.0, _final(1.0, queue_ms=5.0, prompt_tokens=40, cached_tokens=16)),
        _req("stopped", 0, 0.0, 1.0, _final(2.0, "rejected", "deadline", tokens=0, queue_ms=5.0, prompt_tokens=30)),
        _req("never-ran", 0, 0.0, 1.0, _final(2.0, "rejected", "deadline", tokens=0, prompt_tokens=50)),
    ]
    w = wasted_tokens(reqs)
    assert (w["prompt_total"], w["prompt_wasted"]) == (24 + 30, 30)  # the one never scheduled computed nothing
    assert w["prompt_fraction"] == pytest.approx(30 / 54) and w["wasted"] == 0


def test_prediction_ratios_skip_missing_and_zero_predictions_and_unfinished_requests():
    reqs = [
        _req("a", 0, 0.0, 10.0, _final(1.0, queue_ms=100.0, e2e_ms=900.0, predicted_queue_ms=50.0,
                                        predicted_e2e_ms=1000.0)),
        _req("b", 0, 0.0, 10.0, _final(1.0, queue_ms=300.0, e2e_ms=1200.0, predicted_queue_ms=100.0,
                                        predicted_e2e_ms=600.0)),
        _req("c", 1, 0.0, 10.0, _final(1.0, queue_ms=10.0, e2e_ms=500.0, predicted_queue_ms=0.0,
                                        predicted_e2e_ms=250.0)),
        _req("d", 1, 0.0, 10.0, _final(1.0, queue_ms=10.0, e2e_ms=500.0)),  # no predictions
        _req("e", 2, 0.0, 10.0, _final(1.0, "rejected", "deadline", queue_ms=10.0, e2e_ms=500.0,
                                        predicted_queue_ms=1.0, predicted_e2e_ms=1.0)),
    ]
    errors = prediction_errors(reqs)
    assert list(errors) == ["0", "1", "all"]
    assert errors["0"]["queue"] == {"n": 2, "p50": pytest.approx(2.5), "p90": pytest.approx(2.9)}
    assert errors["0"]["e2e"]["p50"] == pytest.approx((0.9 + 2.0) / 2)
    assert errors["1"]["queue"]["n"] == 0 and errors["1"]["queue"]["p50"] is None
    assert errors["1"]["e2e"] == {"n": 1, "p50": pytest.approx(2.0), "p90": pytest.approx(2.0)}
    assert errors["all"]["queue"]["n"] == 2 and errors["all"]["e2e"]["n"] == 3


def test_capacity_is_the_closed_loops_rate_after_its_first_full_turnover():
    # 20 outstanding; the first 20 completions (the cold start, and work sent before the loop was full) are
    # left out, and so is everything after the loop stopped sending at 30 s.
    times = [5.0 + 0.05 * i for i in range(20)] + [6.0 + 0.1 * i for i in range(241)] + [31.0, 32.0]
    assert capacity_from_completions(times, warmup=20, end_s=30.0) == pytest.approx(241 / (30.0 - 5.95))
    assert capacity_from_completions([1.0 + i for i in range(21)], warmup=20, end_s=30.0) is None
    assert capacity_from_completions([1.0] * 30, warmup=0, end_s=30.0) is None


def test_time_series_bins_requests_by_second_and_status_records_by_max_and_any():
    reqs = [
        _req("a", 0, 0.2, 10.0, _final(2.5, queue_ms=500.0), backoff_s=0.5),  # admitted at 1.2
        _req("b", 2, 0.7, 30.0, _final(0.9, "rejected", "shed", tokens=0)),
        _req("c", 1, 1.1, 1.0, _final(3.5, queue_ms=100.0)),  # late
    ]
    statuses = [StatusSample(0.1, [1, 0, 5], [False, False, True], [False, False, False], [None] * 3, 2),
                StatusSample(0.9, [3, 0, 2], [False, False, False], [False, False, True], [None] * 3, 4),
                StatusSample(2.4, [0, 0, 0], [False, False, False], [False, False, False], [None] * 3, 1)]
    ts = time_series(reqs, statuses, 3, 4.0)
    assert ts["bins_s"] == [0, 1, 2, 3]
    assert ts["offered"] == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0]]
    assert ts["admitted"][0] == [0, 1, 0, 0] and ts["admitted"][1] == [0, 1, 0, 0]
    assert ts["completed_in_time"][0] == [0, 0, 1, 0] and ts["completed_late"][1] == [0, 0, 0, 1]
    assert ts["rejected"] == {"shed": [[0] * 4, [0] * 4, [1, 0, 0, 0]]}
    assert ts["queue"][0] == [3, None, 0, None] and ts["queue"][2] == [5, None, 0, None]
    assert ts["paused"][2] == [True, None, False, None] and ts["shed"][2] == [True, None, False, None]
    assert ts["running"] == [4, None, 1, None]
    assert ts["preemptions"] == [0, None, 0, None] and ts["step_ms"] == [0.0, None, 0.0, None]


def test_preemptions_per_second_come_from_the_cumulative_count():
    def sample(at_s, preemptions, step_ms):
        return StatusSample(at_s, [0] * 3, [False] * 3, [False] * 3, [None] * 3, 8, preemptions, step_ms)

    statuses = [sample(0.2, 5, 300.0), sample(0.8, 7, 900.0), sample(2.5, 20, 400.0), sample(3.1, 20, 350.0)]
    ts = time_series([], statuses, 3, 4.0)
    assert ts["preemptions"] == [7, None, 13, 0]  # a second without a record reports nothing, not zero
    assert ts["step_ms"] == [900.0, None, 400.0, 350.0]


def test_engine_rates_come_from_the_cumulative_step_counters():
    def sample(at_s, steps, tokens, busy_ms):
        return StatusSample(at_s, [0] * 3, [False] * 3, [False] * 3, [None] * 3, 8, 0, 0.0, steps, tokens, busy_ms)

    statuses = [sample(0.5, 10, 1000, 400.0), sample(1.5, 14, 1800, 1200.0), sample(3.5, 22, 2600, 2800.0)]
    ts = time_series([], statuses, 3, 4.0)
    assert ts["steps_per_s"] == [None, 4.0, None, 4.0]  # per bin: since the previous sample
    assert ts["tokens_per_step"] == [None, 200.0, None, 100.0]
    assert ts["tokens_per_busy_s"] == [None, 1000.0, None, 500.0]
    assert ts["busy_fraction"] == [None, pytest.approx(0.8), None, pytest.approx(0.8)]
    summary = engine_summary(statuses, 0.0, 4.0)
    assert summary["steps"] == 12 and summary["tokens_per_step"] == 1600 / 12
    assert summary["tokens_per_busy_s"] == 1600 / 2.4 and summary["busy_fraction"] == pytest.approx(0.8)
    assert engine_summary(statuses, 3.0, 4.0)["steps"] is None  # one sample: no interval
    assert summary["engine_cpu_per_s"] is None  # samples without CPU readings
    with_cpu = [dataclasses.replace(s, engine_cpu_s=e, other_cpu_s=o)
                for s, e, o in zip(statuses, (10.0, 10.9, 12.8), (5.0, 5.1, 5.3))]
    summary = engine_summary(with_cpu, 0.0, 4.0)
    # over the 3 s between the first and the last sample
    assert summary["engine_cpu_per_s"] == pytest.approx(2.8 / 3) and summary["other_cpu_per_s"] == pytest.approx(0.1)


def _summary(in_time_by_priority: dict[int, tuple[int, int]], goodput_ratio: float, wasted: float,
             missing: int = 0, duplicates: int = 0) -> dict:
    table = {str(p): {"in_time_fraction": n / sent} for p, (n, sent) in in_time_by_priority.items()}
    return {"table": table, "goodput_over_capacity": goodput_ratio, "wasted_tokens": {"fraction": wasted},
            "num_missing": missing, "num_duplicate_finals": duplicates, "duplicate_ids": ["x"] * duplicates}


def _failed(floors: list[dict]) -> list[str]:
    return [f["check"] for f in floors if not f["pass"]]


def test_floors_at_5x_2x_and_in_every_phase():
    good = _summary({0: (99, 100), 1: (95, 100)}, 0.9, 0.05)
    assert _failed(check_floors("5x", 5.0, good, True)) == []
    assert len(check_floors("5x", 5.0, good, True)) == 6
    bad = _summary({0: (98, 100), 1: (10, 100)}, 0.89, 0.051)
    assert _failed(check_floors("5x", 5.0, bad, True)) == [
        "priority 0 completed within deadline", "goodput / capacity", "wasted tokens / tokens generated"]
    # At 2x priority 1 counts as well; goodput and waste are 5x floors only.
    assert _failed(check_floors("2x", 2.0, bad, True)) == [
        "priority 0 completed within deadline", "priority 1 completed within deadline"]
    assert _failed(check_floors("2x", 2.0, _summary({0: (99, 100)}, 0.1, 0.5), True)) == [
        "priority 1 completed within deadline"]  # none sent: not a pass
    lost = _summary({}, 1.0, 0.0, missing=1, duplicates=2)
    assert _failed(check_floors("capacity", None, lost, False)) == [
        "every request has a final record", "no duplicate final within one attempt",
        "committed offsets reach the log end"]
    assert _failed(check_floors("3x", 3.0, good, None)) == ["committed offsets reach the log end"]


def test_the_worker_cpu_reading_tells_the_engine_thread_from_the_others():
    import os
    import threading
    import time

    from benchmarks.bench_overload import worker_thread_cpu
    from worker.transport.requests.engine_thread import name_os_thread

    done = threading.Event()

    def engine() -> None:  # spins 0.3 CPU s as "engine", then stays alive (a finished thread leaves /proc)
        name_os_thread("engine")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.wait(30)

    before = worker_thread_cpu(os.getpid())
    thread = threading.Thread(target=engine)
    thread.start()
    deadline = time.monotonic() + 20
    while (reading := worker_thread_cpu(os.getpid()))[0] < 0.29 and time.monotonic() < deadline:
        time.sleep(0.02)
    done.set()
    thread.join()
    assert before is not None and before[0] == 0.0  # no thread of this process was named engine yet
    assert reading[0] >= 0.29 and reading[1] >= before[1]  # this test's own thread is among the others
    assert worker_thread_cpu(2**22 + 12345) is None  # no such process
