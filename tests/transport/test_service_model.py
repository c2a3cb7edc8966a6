"""Service estimates in tokens: a cold prior from the step-time model, capacity measured only while
saturated, request costs corrected by what finished requests really used."""

import pytest

from worker.engine.api import EngineStats
from worker.transport.load.service_model import EngineView, ServiceModel

STEP = EngineStats(step_time_base_s=0.05, step_time_per_token_s=0.001)


def make(stats: EngineStats = STEP, saturated: bool = True) -> ServiceModel:
    return ServiceModel(3, max_num_seqs=64, max_num_batched_tokens=512, view=EngineView(stats, saturated))


def test_cold_capacity_comes_from_the_step_time_model():
    model = make()
    for _ in range(20):
        model.observe_read(1, 56, 16)
    # A seat holds a request for 16 steps (its prefill samples the first token); 64 seats × 72 tokens / 16 =
    # 288 tokens a step, under the 512 budget.
    tokens = 64 * 72 / 16
    assert model.saturated_step_tokens() == pytest.approx(tokens)
    assert model.capacity_tokens_per_s() == pytest.approx(tokens / (0.05 + 0.001 * tokens))
    assert make(EngineStats()).capacity_tokens_per_s() is None  # nothing measured, no calibration: no guess
    assert make(EngineStats()).wait_s(1000) is None and make(EngineStats()).wait_s(0) == 0.0


def test_long_prompts_are_bounded_by_the_token_budget():
    model = make()
    model.observe_read(0, 2000, 16)
    assert model.saturated_step_tokens() == 512


def test_measured_capacity_counts_only_saturated_intervals():
    model = make(saturated=False)
    prior = model.capacity_tokens_per_s()
    for i in range(100):  # idle: 10 tokens/s finished, far below what the engine could do
        model.observe_finished(10, 8, 10, 8, True, now=i * 1.0)
    assert model.rate.rate == 0.0 and model.capacity_tokens_per_s() == prior
    model.see(EngineView(STEP, True))
    for i in range(100, 200):
        model.observe_finished(50, 8, 50, 8, True, now=i * 0.1)  # 58 tokens per 0.1 s
    assert model.capacity_tokens_per_s() == pytest.approx(580, rel=0.05)


def test_a_measured_rate_far_below_the_step_time_model_is_raised_to_a_quarter_of_it():
    """An engine starved between its steps (the transport busy with a flood of bad records) measures a rate
    that says nothing about its work; shedding on it would refuse valid requests."""
    model = make()
    for _ in range(20):
        model.observe_read(1, 56, 8)
    modelled = model.capacity_tokens_per_s()  # ~900 tokens/s (the test above)
    for i in range(100):
        model.observe_finished(50, 8, 50, 8, True, now=i * 1.0)  # 58 tokens per second, saturated
    assert model.rate.rate == pytest.approx(58, rel=0.05)
    assert model.capacity_tokens_per_s() == pytest.approx(0.25 * modelled)
    for i in range(400):  # 40 s (8 half-lives) at 580 tokens/s: above the floor, measured again
        model.observe_finished(50, 8, 50, 8, True, now=100 + i * 0.1)
    assert model.capacity_tokens_per_s() == pytest.approx(580, rel=0.05)


def test_costs_learn_the_real_prompt_and_output_lengths():
    model = make()
    assert model.expected_cost(100, 64) == 164  # nothing learnt: the estimates as they are
    for i in range(200):  # prompts are 60% of the estimate; answers stop at a quarter of max_new_tokens (EOS)
        model.observe_finished(100, 64, 60, 16, True, now=float(i))
    assert model.expected_cost(100, 64) == pytest.approx(60 + 16, rel=0.02)
    model.observe_finished(100, 64, 60, 2, False, now=300.0)  # stopped by its deadline: says nothing of EOS
    assert model.output_ratio.value == pytest.approx(0.25, rel=0.02)


def test_unread_records_are_priced_like_their_priority():
    model = make()
    assert model.mean_cost(2) is None
    model.observe_read(0, 10, 10)
    assert model.mean_cost(2) == 20  # nothing read from p2 yet: any priority's mean
    model.observe_read(2, 100, 100)
    assert model.mean_cost(2) == 200 and model.mean_cost(0) == 20


def test_service_time_at_the_batch_it_will_share():
    stats = EngineStats(num_running=3, num_waiting=2, step_time_base_s=0.05, step_time_per_token_s=0.001)
    model = make(stats)
    model.observe_read(0, 56, 8)
    assert model.num_sharing(4) == 9
    # Alone: one prefill step of 56 tokens, which samples the first token, and 7 decode steps: 8 steps of
    # 64 / 8 tokens on average, the same under the linear model as 0.05 + 0.056 + 7 × (0.05 + 0.001) up to
    # the one token the last step does not compute.
    assert model.service_s(56, 8, num_sharing=0) == pytest.approx(8 * (0.05 + 0.001 * 64 / 8))
    # Beside 9 others: 10 seats, 64 / 8 tokens each a step.
    assert model.service_s(56, 8, num_sharing=9) == pytest.approx(8 * (0.05 + 0.001 * 10 * 64 / 8))
    # A full batch: the saturated step (512 tokens: 64 seats of 8), however many more wait.
    t = model.saturated_step_tokens()
    assert t == 512
    assert model.service_s(56, 8, num_sharing=500) == pytest.approx(8 * (0.05 + 0.001 * t))
    assert model.service_s(1200, 8, num_sharing=500) == pytest.approx(10 * (0.05 + 0.001 * t))  # 3 prefill chunks
    assert model.engine_tokens_ahead(2) == pytest.approx(2 * 64)  # no per-priority counts: all count


def test_only_more_urgent_engine_work_is_ahead():
    open_now = [10, 30, 60]  # 100 requests in an engine of 64 seats
    model = ServiceModel(3, max_num_seqs=64, max_num_batched_tokens=512,
                         view=EngineView(STEP, open_by_priority=tuple(open_now)))
    for p in range(3):
        model.observe_read(p, 90, 10)
    assert model.engine_waiting_by_priority() == [0, 0, 36]  # p0 and p1 fit the seats; 36 of p2 wait
    assert model.engine_tokens_ahead(0) == 0 and model.engine_tokens_ahead(1) == 0
    assert model.engine_tokens_ahead(2) == pytest.approx(36 * 100)
    model.see(EngineView(STEP, open_by_priority=(70, 0, 5)))
    assert model.engine_waiting_by_priority() == [6, 0, 5]


def test_the_engines_own_waiting_counts_replace_the_seat_inference():
    # Seats free (20 open of 64), yet requests wait inside the engine: its steps' token budget ran out.
    stats = EngineStats(step_time_base_s=0.05, step_time_per_token_s=0.001, num_waiting_by_priority=(2, 5))
    model = ServiceModel(3, max_num_seqs=64, max_num_batched_tokens=512,
                         view=EngineView(stats, open_by_priority=(8, 12, 0)))
    for p in range(3):
        model.observe_read(p, 90, 10)
    assert model.engine_waiting_by_priority() == [2, 5, 0]
    assert model.engine_tokens_ahead(0) == pytest.approx(2 * 100)
    assert model.engine_tokens_ahead(1) == pytest.approx(7 * 100)
    # Priorities past the transport's count as its last.
    model.see(EngineView(EngineStats(num_waiting_by_priority=(1, 0, 2, 4)), open_by_priority=(8, 12, 0)))
    assert model.engine_waiting_by_priority() == [1, 0, 6]
    # An engine that counts and has none waiting: none, whatever the seats would suggest.
    open_many = ServiceModel(3, max_num_seqs=4, max_num_batched_tokens=512,
                             view=EngineView(EngineStats(num_waiting_by_priority=(0,)), open_by_priority=(10, 0, 0)))
    assert open_many.engine_waiting_by_priority() == [0, 0, 0]


def test_protected_priorities_are_admitted_on_the_squeezed_service():
    from types import SimpleNamespace

    model = make(EngineStats(step_time_base_s=0.05, step_time_per_token_s=0.001, protected_priorities=2))
    model.observe_read(0, 56, 8)
    squeezed = model.squeezed_service_s(56, 8, num_sharing=100)
    # Prefill beside 100 others, then 7 steps of a quarter of the 512-token budget (more than 64 decodes).
    assert squeezed == pytest.approx((0.05 + 0.001 * 156) + 7 * (0.05 + 0.001 * 128))
    assert squeezed < model.service_s(56, 8, num_sharing=100)
    # In a small batch the usual steps are already smaller than the squeezed ones.
    assert model.squeezed_service_s(56, 8, num_sharing=3) == model.service_s(56, 8, num_sharing=3)

    def queued(priority, deadline_ms):
        return SimpleNamespace(priority=priority, deadline_ms=deadline_ms, num_prompt_tokens=56,
                               request=SimpleNamespace(max_new_tokens=8))

    assert model.service_for(queued(0, 10_000), 100) == squeezed
    assert model.service_for(queued(0, None), 100) == model.service_s(56, 8, 100)  # no deadline, no squeeze
    assert model.service_for(queued(1, 10_000), 100) == squeezed
    # The bulk priority, which the engine does not protect, is admitted on full steps.
    assert model.service_for(queued(2, 10_000), 100) == model.service_s(56, 8, 100)
    # An engine that protects nothing (or does not say so): no squeeze for anyone.
    unprotected = make()
    unprotected.observe_read(0, 56, 8)
    assert unprotected.service_for(queued(0, 10_000), 100) == unprotected.service_s(56, 8, 100)


def test_a_busy_engine_takes_new_requests_between_steps():
    busy = EngineStats(num_running=3, last_step_num_tokens=100, step_time_base_s=0.05, step_time_per_token_s=0.001)
    model = make(busy)
    model.rate.rate = 1000.0
    assert model.wait_s(0) == pytest.approx(0.5 * 0.15)  # half the step under way, on average
    assert model.wait_s(500) == pytest.approx(0.075 + 0.5)
    assert make(EngineStats(step_time_base_s=0.05)).wait_s(0) == 0.0  # idle: the next step starts at once


def test_requests_the_engine_refuses_at_once_cost_nothing():
    model = make(EngineStats(step_time_base_s=0.05, step_time_per_token_s=0.001, max_model_len=2048))
    assert model.expected_cost(100, 4096) == 0.0  # max_new_tokens past the model length
    assert model.expected_cost(4500, 2) == 0.0  # a prompt estimated past it
    assert model.expected_cost(2040, 100) == 0.0  # together past it
    assert model.expected_cost(1500, 500) == 2000.0
    for _ in range(100):
        model.observe_read(1, 100, 4096)  # a flood of such records does not price the priority's lag up
    assert model.mean_cost(1) < 1.0
