import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.engine.fake_runner import FakeRunner, Simulation, make_request, make_scheduler, run_to_completion, step
from worker.engine.policies import WaitingQueue


def ids(requests) -> list[str]:
    return [request.request_id for request in requests]


def scheduled_ids(output) -> list[str]:
    return [entry.request_id for entry in output.scheduled]


def test_waiting_queue_orders_by_key_then_add_order_and_removes():
    queue = WaitingQueue(lambda request: (request.priority, request.arrival_time))
    specs = [("a", 1, 0.0), ("b", 0, 5.0), ("c", 1, 0.0), ("d", 0, 1.0)]
    for order, (request_id, priority, arrival) in enumerate(specs):
        queue.push(make_request(request_id, priority=priority, arrival_time=arrival), order)
    assert ids(queue) == ["d", "b", "a", "c"] and ids(queue.first(2)) == ["d", "b"]
    assert queue.oldest_arrival_time() == 0.0 and "c" in queue
    queue.remove(next(r for r in queue if r.request_id == "a"))
    assert ids(queue) == ["d", "b", "c"] and "a" not in queue and len(queue) == 3


def test_waiting_queue_keeps_its_counts_as_requests_come_and_go():
    from worker.engine.request import RequestStatus

    queue = WaitingQueue(lambda request: (request.priority, request.arrival_time))
    assert queue.num_by_priority() == (0,) and queue.num_prompt_tokens == 0
    requests = [make_request("a", 5, priority=2), make_request("b", 7, priority=0),
                make_request("c", 3, priority=-1), make_request("d", 4, priority=1, deadline=9.0)]
    requests[3].status = RequestStatus.PREEMPTED
    for order, request in enumerate(requests):
        queue.push(request, order)
    assert queue.num_by_priority() == (2, 1, 1)  # below 0 counts as 0
    assert queue.num_prompt_tokens == 19 and queue.num_preempted_with_deadline == 1
    assert queue.any_with_deadline_below(2) and not queue.any_with_deadline_below(1)  # "d", priority 1
    requests[3].status = RequestStatus.RUNNING  # admitted: its status changes before it leaves the queue
    queue.remove(requests[3])
    queue.remove(requests[0])
    assert queue.num_by_priority() == (2,) and queue.num_prompt_tokens == 10 and queue.num_preempted_with_deadline == 0
    assert not queue.any_with_deadline_below(3)
    queue.push(make_request("e", 2, priority=-2, deadline=5.0), 9)
    assert queue.any_with_deadline_below(0) and queue.any_with_deadline_below(1)  # below 0: counted at 0
    queue.check_counts()


def test_continuous_admits_a_new_request_at_the_next_step():
    scheduler = make_scheduler()
    runner = FakeRunner(64, 4)
    scheduler.add_request(make_request("first", 4, 10))
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler.add_request(make_request("second", 4, 10, arrival_time=1.0))
    output, _ = step(scheduler, runner)
    assert scheduled_ids(output) == ["first", "second"]


def test_dynamic_forms_a_batch_when_full_and_runs_it_to_completion():
    scheduler = make_scheduler(policy="dynamic", max_batch_size=3, batch_window_ms=1000)
    runner = FakeRunner(64, 4)
    for i in range(2):
        scheduler.add_request(make_request(f"m{i}", 4, 3 + i, arrival_time=0.1 * i))
    assert scheduler.schedule(0.5).is_empty
    assert scheduler.wake_time(0.5) == 1.0  # the oldest one's window closes
    scheduler.add_request(make_request("m2", 4, 5, arrival_time=0.6))
    output, _ = step(scheduler, runner, now=0.6)
    assert scheduled_ids(output) == ["m0", "m1", "m2"]
    scheduler.add_request(make_request("urgent", 4, 2, arrival_time=0.7, priority=-5))
    members = {"m0", "m1", "m2"}
    now = 0.7
    while members & set(scheduler.requests):
        output, _ = step(scheduler, runner, now=now)
        assert "urgent" not in scheduled_ids(output)  # nobody joins a batch in flight
        now += 1.0
    assert scheduler.wake_time(1.5) == 1.7  # urgent has been waiting since 0.7, alone
    assert scheduler.wake_time(now) == now  # its window closed: due now
    output, _ = step(scheduler, runner, now=now)
    assert scheduled_ids(output) == ["urgent"]


def test_dynamic_forms_a_partial_batch_when_the_window_closes():
    scheduler = make_scheduler(policy="dynamic", max_batch_size=4, batch_window_ms=50)
    scheduler.add_request(make_request("a", 4, 2, arrival_time=10.0))
    scheduler.add_request(make_request("b", 4, 2, arrival_time=10.02))
    assert scheduler.schedule(10.049).is_empty
    assert scheduled_ids(scheduler.schedule(10.05)) == ["a", "b"]


def test_dynamic_takes_the_most_urgent_waiting_requests():
    scheduler = make_scheduler(policy="dynamic", max_batch_size=2, batch_window_ms=0)
    for i, priority in enumerate([2, 0, 1, 0]):
        scheduler.add_request(make_request(f"r{i}", 4, 1, arrival_time=float(i), priority=priority))
    assert scheduled_ids(scheduler.schedule(10.0)) == ["r1", "r3"]


def test_batch_members_get_chunked_prefill_and_outsiders_wait():
    scheduler = make_scheduler(policy="dynamic", max_batch_size=3, batch_window_ms=0, max_num_batched_tokens=16)
    runner = FakeRunner(64, 4)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 20, 2, arrival_time=float(i)))
    chunks = []
    for _ in range(4):
        output, _ = step(scheduler, runner, now=10.0)
        chunks.append([(entry.request_id, entry.num_new_tokens) for entry in output.scheduled])
    assert chunks[0] == [("r0", 16)]
    assert chunks[1] == [("r0", 4), ("r1", 12)]
    assert chunks[2] == [("r0", 1), ("r1", 8), ("r2", 7)]
    assert "r3" not in {request_id for chunk in chunks for request_id, _ in chunk}
    run_to_completion(scheduler, runner, now=10.0)


def test_static_batches_in_arrival_order_wait_until_full_and_the_end_of_input_starts_the_rest():
    scheduler = make_scheduler(policy="static", max_batch_size=2)
    runner = FakeRunner(64, 4)
    scheduler.add_request(make_request("a", 4, 3, arrival_time=0.0, priority=2))
    assert scheduler.schedule(100.0).is_empty  # not full, however long it waits
    assert scheduler.wake_time(100.0) is None  # only more requests or the end of input can start it
    scheduler.add_request(make_request("b", 4, 3, arrival_time=1.0, priority=1))
    scheduler.add_request(make_request("c", 4, 3, arrival_time=2.0, priority=0))
    output, _ = step(scheduler, runner, now=2.0)
    assert scheduled_ids(output) == ["a", "b"]  # arrival order: priority is ignored
    scheduler.add_request(make_request("d", 4, 3, arrival_time=3.0, priority=0))
    scheduler.add_request(make_request("e", 4, 3, arrival_time=4.0, priority=0))
    while {"a", "b"} & set(scheduler.requests):
        output, _ = step(scheduler, runner, now=5.0)
        assert set(scheduled_ids(output)) <= {"a", "b"}
    output, _ = step(scheduler, runner, now=6.0)  # c, d, e wait: a full batch of the two oldest
    assert scheduled_ids(output) == ["c", "d"]
    while {"c", "d"} & set(scheduler.requests):
        output, _ = step(scheduler, runner, now=7.0)
        assert set(scheduled_ids(output)) <= {"c", "d"}
    assert scheduler.schedule(8.0).is_empty and scheduler.num_waiting == 1
    assert scheduler.wake_time(8.0) is None
    scheduler.set_input_ended()  # no more requests expected: the partial batch starts
    assert scheduler.wake_time(8.0) == 8.0
    assert scheduled_ids(scheduler.schedule(8.0)) == ["e"]


def random_scheduler(rng: random.Random, policy: str):
    max_num_seqs = rng.randint(1, 6)
    return make_scheduler(
        num_blocks=rng.randint(2, 16),
        max_model_len=rng.randint(4, 64),
        block_size=rng.choice([1, 2, 4]),
        max_num_batched_tokens=rng.randint(1, 40),
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=rng.random() < 0.7,
        policy=policy,
        max_batch_size=rng.randint(1, max_num_seqs),
        batch_window_ms=20,
        # Drawn last, so the other draws (and the sequences' coverage) stay those of the seeds without it.
        kv_window=rng.randint(1, 12) if rng.random() < 0.3 else None,
    )


@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_random_operation_sequences(policy):
    """Seeded random add / step / finish / abort / end of input / clock sequences: the scheduler and block pool
    invariants hold after every operation, and every request finishes with the fake model's own
    continuation however it was batched, preempted, cached or evicted."""
    totals = Counter()
    for seed in range(80):
        rng = random.Random(seed)
        sim = Simulation(random_scheduler(rng, policy))
        for _ in range(rng.randint(1, 60)):
            op = rng.choices(["add", "step", "clock", "finish", "end_input"], weights=[4, 8, 2, 1, 0.2])[0]
            if op == "add":
                deadline = rng.uniform(0, 0.1) if rng.random() < 0.2 else None
                shape = (rng.randint(0, 24), rng.randint(0, 10), rng.randint(1, 8), rng.randint(0, 2))
                sim.add(*shape, deadline, stop_at_eos=rng.random() < 0.5)
            elif op == "step":
                sim.step()
            elif op == "clock":
                sim.advance_clock(rng.uniform(0, 0.05))
            elif op == "finish" and sim.added:
                sim.finish(rng.randrange(len(sim.added)), abort=rng.random() < 0.5)
            elif op == "end_input":
                sim.end_input()
            sim.scheduler.check_invariants()
        sim.drain()
        totals["preemptions"] += sim.scheduler.num_preemptions
        totals["hit_tokens"] += sim.scheduler.pool.num_hit_tokens
        totals["evictions"] += sim.scheduler.pool.num_evictions
        totals["deadline_drops"] += sim.scheduler.num_deadline_drops
        totals["window_freed"] += sim.scheduler.pool.num_window_freed
        totals["requests"] += len(sim.added)
    # The sequences reach every path they claim to test.
    assert all(totals[key] > 0 for key in ("preemptions", "hit_tokens", "evictions", "deadline_drops",
                                           "window_freed")), totals


class RandomOperations(RuleBasedStateMachine):
    """The same operations chosen by Hypothesis, which shrinks a failure to a minimal sequence."""

    @initialize(policy=st.sampled_from(["continuous", "dynamic", "static"]), seed=st.integers(0, 2**16))
    def setup(self, policy, seed):
        self.sim = Simulation(random_scheduler(random.Random(seed), policy))

    @rule(
        num_shared=st.integers(0, 24),
        num_own=st.integers(0, 10),
        max_new_tokens=st.integers(1, 8),
        priority=st.integers(0, 2),
        deadline=st.none() | st.floats(0, 0.1),
        stop_at_eos=st.booleans(),
    )
    def add(self, num_shared, num_own, max_new_tokens, priority, deadline, stop_at_eos):
        self.sim.add(num_shared, num_own, max_new_tokens, priority, deadline, stop_at_eos)

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps):
        for _ in range(num_steps):
            self.sim.step()

    @rule(dt=st.floats(0, 0.05))
    def advance_clock(self, dt):
        self.sim.advance_clock(dt)

    @precondition(lambda self: self.sim.added)
    @rule(index=st.integers(0, 100), abort=st.booleans())
    def finish(self, index, abort):
        self.sim.finish(index, abort)

    @rule()
    def end_input(self):
        self.sim.end_input()

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "sim"):
            self.sim.scheduler.check_invariants()

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.drain()


RandomOperations.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_operations_hypothesis = RandomOperations.TestCase


@pytest.mark.slow
def test_a_request_that_left_the_queue_is_not_kept_until_its_deadline():
    """A deadline an hour away must not keep a finished request (its tokens, its block table) for an hour: a
    worker at 100 requests/s would hold 360,000 of them."""
    import gc

    from worker.engine.request import Request

    scheduler = make_scheduler(num_blocks=256)
    runner = FakeRunner(256, 4)
    for wave in range(10):
        for i in range(50):
            scheduler.add_request(make_request(f"far-deadline-{wave}-{i}", 6, 3, deadline=3600.0))
        run_to_completion(scheduler, runner)
    gc.collect()
    kept = [o for o in gc.get_objects() if isinstance(o, Request) and o.request_id.startswith("far-deadline-")]
    assert not kept, f"{len(kept)} finished requests still referenced"
    # Requests that wait keep their deadlines, and an expired one is still dropped.
    scheduler.add_request(make_request("waits", 6, 3, deadline=1.0))
    assert scheduler.waiting.earliest_deadline() == 1.0
    assert [r.request_id for r in scheduler.waiting.pop_expired(2.0)] == ["waits"]
