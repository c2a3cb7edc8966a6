import pytest

from tests.engine.fake_runner import FakeRunner, make_request, make_scheduler, next_token, run_to_completion, step
from worker.engine.api import SamplingParams, fair_preempts
from worker.engine.request import RequestStatus


def scheduled_ids(output) -> list[str]:
    return [entry.request_id for entry in output.scheduled]


def solo_output(prompt_token_ids: list[int], num_tokens: int) -> list[int]:
    """What the fake greedy model generates for a prompt alone."""
    context = list(prompt_token_ids)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt_token_ids) :]


def test_budget_and_max_num_seqs_hold_every_step():
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=5)
    runner = FakeRunner(40, 4)
    requests = [make_request(f"r{i}", 3 + (i * 7) % 30, 1 + i % 6, arrival_time=i) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler, runner)  # `step` asserts the budget and max_num_seqs
    assert max(output.num_batched_tokens for output in outputs) == 32
    assert max(len(output.scheduled) for output in outputs) == 5
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == solo_output(request.prompt_token_ids, request.sampling.max_new_tokens)


def test_chunked_prefill_does_not_stall_decoding():
    scheduler = make_scheduler(num_blocks=100, block_size=16, max_num_batched_tokens=64)
    runner = FakeRunner(100, 16)
    decoder = make_request("decoder", 8, max_new_tokens=100)
    scheduler.add_request(decoder)
    step(scheduler, runner)  # decoder's prefill
    long = make_request("long", 1000, max_new_tokens=2, arrival_time=1.0)
    scheduler.add_request(long)
    num_steps = 0
    while not long.output_token_ids:
        output, updates = step(scheduler, runner)
        num_steps += 1
        chunks = {entry.request_id: entry for entry in output.scheduled}
        assert chunks["decoder"].num_new_tokens == 1 and chunks["decoder"].samples
        assert [update.request_id for update in updates][0] == "decoder"
        assert chunks["long"].num_new_tokens == min(63, 1000 - chunks["long"].num_computed_before)
        assert chunks["long"].samples == (chunks["long"].seq_len == 1000)
    assert num_steps == 16  # ceil(1000 / 63)


def test_a_later_request_starts_with_the_leftover_of_the_last_prefill_chunk():
    # Admission comes after the running requests' chunks, so a newcomer does not overtake a prefill in
    # flight (FCFS); it starts in the step that finishes that prefill, with the budget left over.
    scheduler = make_scheduler(num_blocks=100, block_size=16, max_num_batched_tokens=64)
    runner = FakeRunner(100, 16)
    long = make_request("long", 300, max_new_tokens=20)
    short = make_request("short", 8, max_new_tokens=20, arrival_time=1.0)
    scheduler.add_request(long)
    scheduler.add_request(short)
    chunks = [[(e.request_id, e.num_new_tokens) for e in step(scheduler, runner)[0].scheduled] for _ in range(6)]
    assert chunks[:4] == [[("long", 64)]] * 4
    assert chunks[4] == [("long", 44), ("short", 8)]
    assert chunks[5] == [("long", 1), ("short", 1)]


def test_admission_in_priority_order_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64, 4)
    specs = [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 0.5), ("e", 1, 2.0)]
    for request_id, priority, arrival in specs:
        scheduler.add_request(make_request(request_id, 5, 2, arrival_time=arrival, priority=priority))
    first_seen = []
    for output in run_to_completion(scheduler, runner):
        for entry in output.scheduled:
            if entry.request_id not in first_seen:
                first_seen.append(entry.request_id)
    assert first_seen == ["d", "b", "c", "e", "a"]  # c and e: same priority and arrival -> added order


def test_waiting_requests_are_counted_by_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    assert scheduler.num_waiting_by_priority() == (0,)  # counted: none wait
    for request_id, priority in [("a", 2), ("b", 0), ("c", 2)]:
        scheduler.add_request(make_request(request_id, 5, 2, priority=priority))
    assert scheduler.num_waiting_by_priority() == (1, 0, 2)
    step(scheduler, FakeRunner(64, 4))  # b starts: its one seat is taken
    assert scheduler.num_waiting_by_priority() == (0, 0, 2)


def test_a_priority_0_request_started_without_the_margin_meets_its_deadline_beside_bulk_prefills():
    """The outcome of the priority-0 floor squeeze (deadline_budget): a request admitted on the promise of the
    smallest steps, with too little time for the margin, finishes in time while long prompts would fill every
    step; on a clock that advances by the step-time model's time for each step's tokens."""
    scheduler = make_scheduler(num_blocks=256, block_size=16, max_num_batched_tokens=512)
    runner = FakeRunner(256, 16)
    cost = (0.01, 0.0005)  # 10 ms + 0.5 ms a token: a full step 266 ms, the smallest (128 tokens) 74 ms
    for i in range(4):
        scheduler.add_request(make_request(f"bulk{i}", 600, 4, priority=2))
    now = 0.0

    def advance() -> int:
        nonlocal now
        output = scheduler.schedule(now, step_cost=cost)
        now += cost[0] + cost[1] * output.num_batched_tokens
        scheduler.update(output, runner.step(output), now)
        scheduler.check_invariants()
        return output.num_batched_tokens

    assert advance() == 512  # bulk prefill
    # 9 steps (prefill + 8 decodes) of 74 ms = 0.67 s fit its 0.68 s, with 0.8 of it they would not.
    urgent = make_request("urgent", 4, 9, arrival_time=now, deadline=now + 0.68)
    scheduler.add_request(urgent)
    sizes = []
    while urgent.status is not RequestStatus.FINISHED_LENGTH:
        assert urgent.status in (RequestStatus.WAITING, RequestStatus.RUNNING), urgent.status
        sizes.append(advance())
    assert now <= urgent.deadline and len(urgent.output_token_ids) == 9
    assert max(sizes) <= 128  # the bulk went on in steps at the floor meanwhile
    assert advance() == 512  # and gets full steps again once it is done


def test_fcfs_by_arrival_time_within_a_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id, arrival in [("x", 3.0), ("y", 1.0), ("z", 2.0)]:
        scheduler.add_request(make_request(request_id, 4, 1, arrival_time=arrival))
    assert [request.request_id for request in scheduler.waiting] == ["y", "z", "x"]
    order = [output.scheduled[0].request_id for output in run_to_completion(scheduler, FakeRunner(64, 4))]
    assert order == ["y", "z", "x"]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_by_recompute_resumes_with_identical_outputs(enable_prefix_caching):
    # 6 blocks of 4: each request grows to 20 tokens (5 blocks), so both cannot run to the end together.
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(6, 4)
    urgent = make_request("urgent", 8, 12, arrival_time=1.0, priority=0)
    late = make_request("late", 8, 12, arrival_time=0.0, priority=1)
    scheduler.add_request(late)
    scheduler.add_request(urgent)
    outputs = run_to_completion(scheduler, runner)
    preempted = [request_id for output in outputs for request_id in output.preempted_request_ids]
    assert preempted and set(preempted) == {"late"}
    assert scheduler.num_preemptions == len(preempted) == late.num_preemptions and urgent.num_preemptions == 0
    for request in (urgent, late):
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == solo_output(request.prompt_token_ids, 12)
    # Token accounting: each step continues exactly where the last left off; after a preemption the request
    # restarts at its prefix-cache hit (a whole number of blocks; 0 without caching) and samples only at the end.
    num_computed, resume_starts, resumed = 0, [], False
    for output in outputs:
        for entry in output.scheduled:
            if entry.request_id == "late":
                if resumed:
                    resume_starts.append(entry.num_computed_before)
                    assert entry.num_computed_before % 4 == 0
                else:
                    assert entry.num_computed_before == num_computed
                num_computed, resumed = entry.seq_len, False
        resumed = resumed or "late" in output.preempted_request_ids
    assert num_computed == late.num_tokens - 1
    assert len(resume_starts) == len(preempted)
    assert any(resume_starts) == enable_prefix_caching
    assert scheduler.pool.num_used_blocks == 0


def test_victim_is_the_request_itself_when_it_is_least_urgent():
    scheduler = make_scheduler(num_blocks=4)
    runner = FakeRunner(4, 4)
    urgent = make_request("urgent", 4, 10, priority=0)
    low = make_request("low", 8, 10, priority=1)
    scheduler.add_request(urgent)
    scheduler.add_request(low)
    step(scheduler, runner)  # urgent: 1 block (+1 at its first decode), low: 2 blocks
    output, _ = step(scheduler, runner)  # urgent takes the last block; low (position 8) needs one more
    assert output.preempted_request_ids == ["low"]
    assert [entry.request_id for entry in output.scheduled] == ["urgent"]
    assert low.status is RequestStatus.PREEMPTED and low.block_ids == [] and low.num_computed_tokens == 0
    assert low.output_token_ids  # kept: recompute covers prompt + output
    assert scheduler.num_waiting == 1 and scheduler.num_running == 1


def test_victim_scheduled_earlier_in_the_step_is_unscheduled_and_its_budget_refunded():
    scheduler = make_scheduler(num_blocks=4)
    runner = FakeRunner(4, 4)
    low = make_request("low", 6, 10, priority=1)
    scheduler.add_request(low)
    step(scheduler, runner)  # low alone: 6 tokens, 2 blocks
    urgent = make_request("urgent", 8, 10, priority=0, arrival_time=1.0)
    scheduler.add_request(urgent)
    step(scheduler, runner)  # low decodes at position 6, urgent is admitted: 2 blocks, pool full
    newcomer = make_request("newcomer", 3, 1, priority=0, arrival_time=2.0)
    scheduler.add_request(newcomer)
    output, _ = step(scheduler, runner)  # low (scheduled first) fits; urgent at position 8 needs a block
    assert output.preempted_request_ids == ["low"]
    # Nobody is admitted in a step that had to preempt, though a block is free now: blocks are short, and
    # a newcomer would only be preempted in turn.
    assert [(entry.request_id, entry.num_new_tokens) for entry in output.scheduled] == [("urgent", 1)]
    assert output.num_batched_tokens == 1
    run_to_completion(scheduler, runner)
    assert low.output_token_ids == solo_output(low.prompt_token_ids, 10)


def test_a_waiting_request_that_does_not_fit_blocks_those_behind_it():
    scheduler = make_scheduler(num_blocks=6)
    runner = FakeRunner(6, 4)
    scheduler.add_request(make_request("running", 14, 10))
    step(scheduler, runner)  # 4 blocks held, 2 free
    big = make_request("big", 12, 1, priority=0, arrival_time=1.0)  # needs 3 blocks
    small = make_request("small", 4, 1, priority=1, arrival_time=1.0)  # would fit in 1
    scheduler.add_request(big)
    scheduler.add_request(small)
    output, _ = step(scheduler, runner)
    assert [entry.request_id for entry in output.scheduled] == ["running"]  # small may not overtake big
    run_to_completion(scheduler, runner)
    assert big.first_scheduled_time is not None and small.is_finished


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    runner = FakeRunner(16, 4)
    running, waiting = make_request("running", 10, 5), make_request("waiting", 10, 5, arrival_time=1.0)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    output = scheduler.schedule(0.0)
    sampled = runner.step(output)
    assert scheduler.pool.num_used_blocks == 3
    aborted = scheduler.abort(["running", "waiting", "unknown"], now=0.5)
    assert aborted == [running, waiting]
    assert all(r.status is RequestStatus.FINISHED_ABORTED and r.finish_time == 0.5 for r in aborted)
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.has_unfinished()
    # The step that was in flight comes back: its aborted requests are skipped.
    assert scheduler.update(output, sampled, 1.0) == []
    assert scheduler.schedule(1.0).is_empty
    scheduler.check_invariants()


def test_a_deadline_ends_waiting_and_running_requests_alike():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64, 4)
    running = make_request("running", 4, 10, deadline=1.0)
    late = make_request("late", 4, 10, arrival_time=0.1, deadline=5.0)
    on_time = make_request("on_time", 4, 1, arrival_time=0.2, deadline=50.0)
    for request in (running, late, on_time):
        scheduler.add_request(request)
    step(scheduler, runner, now=0.5)
    assert scheduler.wake_time(0.5) == 0.5  # "running" runs at every step
    step(scheduler, runner, now=0.6)
    assert running.num_output_tokens == 2
    output, _ = step(scheduler, runner, now=1.0)  # its deadline: it stops, with the two tokens it has
    assert output.deadline_dropped == [running] and running.status is RequestStatus.FINISHED_DEADLINE
    assert running.output_token_ids and running.block_ids == [] and "running" not in scheduler.requests
    assert scheduled_ids(output) == ["late"]  # its seat went to the next one at once
    output, _ = step(scheduler, runner, now=5.0)
    assert output.deadline_dropped == [late] and scheduler.num_deadline_drops == 2
    run_to_completion(scheduler, runner, now=6.0)
    assert on_time.status is RequestStatus.FINISHED_LENGTH


def test_a_request_that_cannot_finish_before_its_deadline_is_not_started():
    scheduler = make_scheduler(max_num_seqs=4)
    runner = FakeRunner(64, 4)
    # Steps of 0.2 s + 0.1 ms a token: alone, a prefill step and 10 decode steps end at about 2.2 s.
    hopeless = make_request("hopeless", 4, 10, priority=2, deadline=2.0)  # the bulk priority: judged on these steps
    feasible = make_request("feasible", 4, 10, priority=2, arrival_time=0.1, deadline=2.5)
    free = make_request("free", 4, 10, arrival_time=0.2)  # no deadline: never refused
    for request in (hopeless, feasible, free):
        scheduler.add_request(request)
    output = scheduler.schedule(0.0, step_cost=(0.2, 0.0001))
    assert output.deadline_dropped == [hopeless] and hopeless.status is RequestStatus.FINISHED_DEADLINE
    assert hopeless.first_scheduled_time is None and hopeless.block_ids == []  # never ran: nothing wasted
    assert sorted(scheduled_ids(output)) == ["feasible", "free"]
    scheduler.update(output, runner.step(output), 0.0)
    # Once running, it keeps going while its remaining 9 tokens fit before its deadline on the smallest steps...
    output = scheduler.schedule(0.1, step_cost=(0.2, 0.0001))
    assert output.deadline_dropped == [] and sorted(scheduled_ids(output)) == ["feasible", "free"]
    scheduler.update(output, runner.step(output), 0.1)
    # ...and stops, with what it has, once they do not (steps of 0.3 s: 8 tokens need 2.4 s, 2.3 s are left).
    output = scheduler.schedule(0.2, step_cost=(0.3, 0.0))
    assert output.deadline_dropped == [feasible] and feasible.status is RequestStatus.FINISHED_DEADLINE
    assert feasible.num_output_tokens == 2 and scheduled_ids(output) == ["free"]  # no deadline: never stopped
    scheduler.check_invariants()


def test_a_protected_request_is_started_on_the_promise_of_smaller_steps():
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=512)
    cost = (0.01, 0.001)  # a full 512-token step takes 0.52 s, a quarter of it 0.14 s
    scheduler.add_request(make_request("long", 600, 4, arrival_time=0.1, priority=2))  # the next steps are full
    # 11 steps (a prefill and 10 decodes) with 3 s to go: 5.7 s on full steps, 1.5 s on the smallest.
    urgent = make_request("urgent", 4, 10, priority=1, deadline=3.0)
    bulk = make_request("bulk", 4, 10, priority=2, deadline=3.0)
    scheduler.add_request(urgent)
    scheduler.add_request(bulk)
    output = scheduler.schedule(0.0, step_cost=cost)
    assert output.deadline_dropped == [bulk]  # the bulk priority is judged on full steps
    assert "urgent" in scheduled_ids(output)
    scheduler.check_invariants()


def test_the_step_that_prefills_an_urgent_request_is_small_too():
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=512)
    cost = (0.01, 0.0005)
    scheduler.add_request(make_request("long", 600, 4, priority=2))  # would fill a whole step
    urgent = make_request("urgent", 4, 10, priority=0, arrival_time=0.1, deadline=1.0)
    scheduler.add_request(urgent)
    # Waiting, it needs 10 steps (a prefill that samples its first token, 9 decodes): 0.8 × 1 s / 10 = 80 ms
    # a step, at most 140 tokens; the long prompt takes the rest of that step after the urgent one's 4.
    output = scheduler.schedule(0.0, step_cost=cost)
    assert output.num_batched_tokens == 140 and sorted(scheduled_ids(output)) == ["long", "urgent"]
    scheduler.check_invariants()


def test_below_the_most_urgent_priority_a_protected_request_starts_only_with_the_margin():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=512)
    # 11 steps (a prefill that samples the first of 11 tokens, 10 decodes) of at least a quarter budget
    # (128 tokens): 11 × 0.2128 = 2.34 s; 2.5 s fit, but not with the step sizing's 20 % to spare.
    cost = (0.2, 0.0001)
    urgent = make_request("urgent", 4, 11, priority=0, deadline=2.5)
    second = make_request("second", 4, 11, priority=1, arrival_time=0.1, deadline=2.5)
    roomy = make_request("roomy", 4, 11, priority=1, arrival_time=0.2, deadline=3.0)
    for request in (urgent, second, roomy):
        scheduler.add_request(request)
    output = scheduler.schedule(0.0, step_cost=cost)
    assert output.deadline_dropped == [second] and sorted(scheduled_ids(output)) == ["roomy", "urgent"]
    scheduler.check_invariants()


def test_steps_shrink_so_a_running_request_keeps_its_deadline():
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=512)
    runner = FakeRunner(256, 4)
    urgent = make_request("urgent", 4, 10, deadline=1.0)
    scheduler.add_request(urgent)
    step(scheduler, runner, now=0.0)  # prefill and its first token: 9 tokens left, 1 s to go
    scheduler.add_request(make_request("long", 600, 4, arrival_time=0.1))
    cost = (0.01, 0.0005)  # a step of T tokens takes 10 ms + 0.5 ms per token
    # 0.8 × 1 s / 9 tokens = 89 ms a step: at most 157 tokens (1 decode + 156 of the long prompt).
    assert scheduler.deadline_budget(0.0, cost) == 157
    output = scheduler.schedule(0.0, step_cost=cost)
    assert output.num_batched_tokens == 157 and sorted(scheduled_ids(output)) == ["long", "urgent"]
    scheduler.update(output, runner.step(output), 0.0)
    assert scheduler.deadline_budget(0.0, (0.0, 0.0)) == 512  # no step-time model: the full budget
    # A request that cannot be saved even by the smallest step (a quarter of the budget) shrinks nothing.
    assert scheduler.deadline_budget(0.5, cost) == 512
    # One that fits on the smallest steps only without the margin (8 × 74 ms = 0.59 s of 0.65 s) gets steps at
    # that floor if it is of priority 0 (it was started on that promise: _cannot_finish) ...
    assert scheduler.deadline_budget(0.35, cost) == 128
    # ... and shrinks nothing otherwise: steps at the floor for each such request would cost every other
    # request a share of its throughput.
    urgent.priority = 1
    assert scheduler.deadline_budget(0.35, cost) == 512
    urgent.priority = 0
    assert scheduler.deadline_budget(0.42, cost) == 512  # 0.58 s left: not even the floor saves it
    # Only the protected priorities (0 and 1 by default) are: a bulk request near its deadline is not.
    urgent.priority = 1  # (8 tokens left now: 0.8 × 1 s / 8 = 100 ms a step, 180 tokens)
    assert scheduler.deadline_budget(0.0, cost) == 180
    urgent.priority = 2
    assert scheduler.deadline_budget(0.0, cost) == 512
    scheduler.protected_priorities = 1
    urgent.priority = 1
    assert scheduler.deadline_budget(0.0, cost) == 512
    scheduler.check_invariants()


def test_a_more_urgent_request_preempts_a_less_urgent_one_for_a_seat():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(64, 4)
    for rid, priority in (("bulk-a", 2), ("bulk-b", 1)):
        scheduler.add_request(make_request(rid, 4, 20, priority=priority))
    step(scheduler, runner, now=0.0)
    scheduler.add_request(make_request("urgent", 4, 3, arrival_time=0.5, priority=0))
    output, _ = step(scheduler, runner, now=0.5)
    assert output.preempted_request_ids == []  # one step's grace: a finishing request may free a seat
    output, _ = step(scheduler, runner, now=0.55)
    assert output.preempted_request_ids == ["bulk-a"]  # none did: the least urgent goes, not bulk-b
    assert set(scheduled_ids(output)) == {"bulk-b", "urgent"}
    scheduler.add_request(make_request("same", 4, 3, arrival_time=0.6, priority=0))
    step(scheduler, runner, now=0.6)
    output, _ = step(scheduler, runner, now=0.65)
    assert output.preempted_request_ids == ["bulk-b"]
    scheduler.add_request(make_request("peer", 4, 3, arrival_time=0.7, priority=0))
    for now in (0.7, 0.75):
        output, _ = step(scheduler, runner, now=now)
        assert output.preempted_request_ids == []  # never within a priority
    run_to_completion(scheduler, runner, now=1.0)


def test_a_seat_freed_by_a_finishing_request_spares_a_preemption():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(64, 4)
    scheduler.add_request(make_request("short", 4, 2, priority=2))
    scheduler.add_request(make_request("long", 4, 20, priority=2))
    step(scheduler, runner, now=0.0)  # both prefill, "short" has its first token
    scheduler.add_request(make_request("urgent", 4, 3, arrival_time=0.1, priority=0))
    output, _ = step(scheduler, runner, now=0.1)  # seats full: urgent waits; "short" finishes
    assert output.preempted_request_ids == [] and "urgent" not in scheduled_ids(output)
    output, _ = step(scheduler, runner, now=0.2)
    assert output.preempted_request_ids == [] and "urgent" in scheduled_ids(output)  # the freed seat
    run_to_completion(scheduler, runner, now=1.0)


def test_shared_prefix_hits_reuse_blocks():
    scheduler = make_scheduler(num_blocks=32)
    runner = FakeRunner(32, 4)
    base = list(range(1, 17))
    first = make_request("first", prompt_token_ids=base + [20, 21, 22], max_new_tokens=30)
    scheduler.add_request(first)
    step(scheduler, runner)
    second = make_request("second", prompt_token_ids=base + [30], max_new_tokens=3, arrival_time=1.0)
    scheduler.add_request(second)
    output, _ = step(scheduler, runner)
    entry = output.scheduled[-1]
    assert entry.request_id == "second" and entry.num_computed_before == 16 and entry.num_new_tokens == 1
    assert second.num_cached_tokens == 16 and second.block_ids[:4] == first.block_ids[:4]
    assert [scheduler.pool.ref_count(block_id) for block_id in first.block_ids[:4]] == [2, 2, 2, 2]
    assert (scheduler.pool.num_queried_tokens, scheduler.pool.num_hit_tokens) == (19 + 17, 16)
    run_to_completion(scheduler, runner)
    assert second.output_token_ids == solo_output(second.prompt_token_ids, 3)
    # The same prompt again: everything but its last block comes from the cache.
    again = make_request("again", prompt_token_ids=base + [20, 21, 22], max_new_tokens=2, arrival_time=2.0)
    scheduler.add_request(again)
    run_to_completion(scheduler, runner)
    assert again.num_cached_tokens == 16 and again.output_token_ids == first.output_token_ids[:2]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_sibling_completions_wait_for_the_leaders_prompt_then_take_its_blocks_from_the_cache(enable_prefix_caching):
    scheduler = make_scheduler(num_blocks=32, enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(32, 4)
    prompt = list(range(1, 19))  # 4 full blocks and 2 tokens
    leader = make_request("r/0", prompt_token_ids=prompt, max_new_tokens=3)
    siblings = [make_request(f"r/{i}", prompt_token_ids=prompt, max_new_tokens=3, prefix_leader="r/0")
                for i in (1, 2)]
    for request in (leader, *siblings):
        scheduler.add_request(request)
    output, _ = step(scheduler, runner)
    if not enable_prefix_caching:  # nothing to share: all start at once
        assert scheduled_ids(output) == ["r/0", "r/1", "r/2"]
        return
    assert scheduled_ids(output) == ["r/0"]
    output, _ = step(scheduler, runner)
    assert scheduled_ids(output) == ["r/0", "r/1", "r/2"]
    assert [s.num_cached_tokens for s in siblings] == [16, 16]
    assert all(s.block_ids[:4] == leader.block_ids[:4] for s in siblings)
    run_to_completion(scheduler, runner)
    assert leader.output_token_ids == siblings[0].output_token_ids == solo_output(prompt, 3)


def test_stop_conditions():
    scheduler = make_scheduler(max_model_len=12)
    prompt = [5, 6, 7, 8]
    first = next_token(prompt)
    eos = make_request("eos", prompt_token_ids=prompt, max_new_tokens=5, eos_token_ids=(first,))
    ignore = make_request(
        "ignore",
        prompt_token_ids=prompt,
        eos_token_ids=(first,),
        sampling=SamplingParams(max_new_tokens=5, ignore_eos=True),
    )
    stop_id = make_request("stop_id", prompt_token_ids=prompt, sampling=SamplingParams(stop_token_ids=(first,)))
    too_long = make_request("too_long", prompt_token_ids=prompt + [9, 9, 9, 9], max_new_tokens=100)
    for request in (eos, ignore, stop_id, too_long):
        scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(64, 4))
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [first]
    assert eos.stop_reason == first
    assert ignore.status is RequestStatus.FINISHED_LENGTH and len(ignore.output_token_ids) == 5
    assert stop_id.status is RequestStatus.FINISHED_STOPPED and stop_id.output_token_ids == [first]
    assert too_long.status is RequestStatus.FINISHED_LENGTH and too_long.num_tokens == 12


def test_updates_report_tokens_and_finish_status():
    scheduler = make_scheduler()
    runner = FakeRunner(64, 4)
    request = make_request("r", 4, 2)
    scheduler.add_request(request)
    _, updates = step(scheduler, runner)
    assert [(u.request_id, u.new_token_ids, u.finish_status) for u in updates] == [
        ("r", request.output_token_ids[:1], None)
    ]
    _, updates = step(scheduler, runner)
    assert updates[0].finished and updates[0].finish_status is RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished() and scheduler.pool.num_used_blocks == 0


def test_finish_requests_for_stop_strings():
    scheduler = make_scheduler()
    runner = FakeRunner(64, 4)
    request = make_request("r", 9, 50)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert scheduler.finish_requests(["r"], RequestStatus.FINISHED_STOPPED, now=3.0) == [request]
    assert request.status is RequestStatus.FINISHED_STOPPED and scheduler.pool.num_used_blocks == 0
    assert scheduler.finish_requests(["r"], RequestStatus.FINISHED_STOPPED) == []


def test_length_is_capped_by_the_pool_so_a_lone_request_always_fits():
    scheduler = make_scheduler(num_blocks=3, max_model_len=4096)
    assert scheduler.max_model_len == 12
    request = make_request("r", 10, 100)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(3, 4))
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12
    assert scheduler.num_preemptions == 0


def test_add_request_rejects_bad_requests():
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("a", 15, 1))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("a", 4, 1))
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_request(make_request("b", 16, 1))
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_request(make_request("c", prompt_token_ids=[]))
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)


def test_a_tenant_holding_no_seat_takes_one_from_a_tenant_holding_all_never_from_its_own():
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=2)
    runner = FakeRunner(40, 4)
    for i in range(2):
        flood = make_request(f"flood-{i}", 4, 50, priority=1, arrival_time=i)
        flood.tenant, flood.fair_tag = "flood", 5000.0 + i
        scheduler.add_request(flood)
    step(scheduler, runner)
    own = make_request("flood-late", 4, 5, priority=1, arrival_time=2.0)
    own.tenant, own.fair_tag = "flood", 100.0  # owed service, but by its own tenant: it waits its turn
    scheduler.add_request(own)
    for _ in range(3):
        output, _ = step(scheduler, runner)
        assert not output.preempted_request_ids
    scheduler.abort(["flood-late"])
    calm = make_request("calm", 4, 20, priority=1, arrival_time=4.0)
    calm.tenant, calm.fair_tag = "calm", 1000.0
    scheduler.add_request(calm)
    preempted = []
    for _ in range(3):  # it first waits one step for a seat to free itself
        output, _ = step(scheduler, runner)
        preempted += output.preempted_request_ids
    assert preempted == ["flood-1"] and calm.status is RequestStatus.RUNNING
    # One seat each now: in step, nobody trades places, whatever the tags.
    near = make_request("near", 4, 5, priority=1, arrival_time=5.0)
    near.tenant, near.fair_tag = "near", 0.0
    scheduler.add_request(near)
    for _ in range(3):
        output, _ = step(scheduler, runner)
        assert not output.preempted_request_ids
    scheduler.check_invariants()
    assert not fair_preempts(near, scheduler.requests["flood-0"], ["flood", "calm"])
    assert fair_preempts(near, scheduler.requests["flood-0"], ["flood", "flood"])
    assert not fair_preempts(own, scheduler.requests["flood-0"], ["flood", "flood"])  # its own tenant


@pytest.mark.parametrize("kv_window", [8, None])
def test_a_long_generation_holds_only_the_blocks_its_window_reaches(kv_window):
    """A request generating ten times its window: with every layer windowed (8 tokens, blocks of 4) it holds at
    most window / block_size + 1 blocks at any step; keeping every block, it ends up holding its whole context."""
    scheduler = make_scheduler(num_blocks=64, kv_window=kv_window)
    runner = FakeRunner(64, 4, kv_window)
    request = make_request("a", 10, max_new_tokens=80)
    scheduler.add_request(request)
    most_held = 0
    while scheduler.has_unfinished():
        output, _ = step(scheduler, runner)
        most_held = max(most_held, len(request.block_ids) - request.num_freed_blocks)
    assert request.num_output_tokens == 80 and request.output_token_ids[-1] == next_token(request.all_token_ids[:-1])
    if kv_window is None:
        assert most_held == 88 // 4  # the first 88 tokens' blocks; the last step's goes back as the request ends
    else:
        assert most_held <= kv_window // 4 + 1
        assert scheduler.pool.num_free_blocks == 64


STEP_COST = (0.040, 0.0045)  # a CPU's decode: 40 ms + 4.5 ms a token, so a step of 22 rows takes 139 ms


def _tenant_request(request_id: str, tenant: str, max_new_tokens: int, arrival_time: float,
                    num_prompt_tokens: int = 4):
    request = make_request(request_id, num_prompt_tokens, max_new_tokens, priority=1, arrival_time=arrival_time)
    request.tenant = tenant
    return request


def _run_flood_and_calm(fair_step_ms: float, calm_prompt_tokens: int = 4) -> dict:
    """A flood tenant holding 20 seats, then two calm tenants' requests of 16 tokens; steps timed by STEP_COST.
    Returns the simulated seconds each calm request took from its first step to its last, the flood's rows per
    step while the calm ones ran, and every request at the end."""
    scheduler = make_scheduler(num_blocks=1000, max_num_seqs=24, fair_step_ms=fair_step_ms)
    runner = FakeRunner(1000, 4)
    requests = [_tenant_request(f"flood-{i}", "flood", 120, i * 1e-3) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    now = 0.0
    for _ in range(3):
        output, _ = step(scheduler, runner, now, STEP_COST)
        now += STEP_COST[0] + STEP_COST[1] * output.num_batched_tokens
    calm = [_tenant_request(f"{tenant}-0", tenant, 16, now, calm_prompt_tokens) for tenant in ("a", "b")]
    for request in calm:
        scheduler.add_request(request)
    requests += calm
    flood_rows, started = [], {}
    while scheduler.has_unfinished():
        output, _ = step(scheduler, runner, now, STEP_COST)
        for entry in output.scheduled:
            started.setdefault(entry.request_id, now)
        if any(not request.is_finished for request in calm):
            flood_rows.append(sum(entry.request.tenant == "flood" for entry in output.scheduled))
        now += STEP_COST[0] + STEP_COST[1] * output.num_batched_tokens
        for request in calm:
            if request.is_finished and request.request_id not in started.get("done", {}):
                started.setdefault("done", {})[request.request_id] = now - started[request.request_id]
    return {"calm_s": started["done"], "flood_rows": flood_rows, "requests": requests,
            "preemptions": scheduler.num_preemptions}


def test_a_fair_step_target_keeps_a_calm_tenants_steps_short_while_a_flood_holds_most_seats():
    """ENGINE_FAIR_STEP_MS at 80 ms (8 tokens at STEP_COST): while the calm tenants run, the flood decodes 6 rows
    a step instead of 20, so their 16 tokens take about 16 short steps; the flood loses no request and no
    progress (its rows wait, keeping their KV), and gets going at full width once they are done."""
    cut = _run_flood_and_calm(80.0)
    full = _run_flood_and_calm(0.0)
    for run in (cut, full):
        assert all(request.status is RequestStatus.FINISHED_LENGTH for request in run["requests"])
        assert run["preemptions"] == 0
    assert max(full["flood_rows"]) == 20 and min(cut["flood_rows"]) >= 1
    assert max(cut["flood_rows"]) <= 8 - 2 + 2  # the first step's prompts: the flood gets as much as one of them
    for request_id, seconds in cut["calm_s"].items():
        assert seconds <= 16 * 0.080 * 1.15, (request_id, seconds)
        assert seconds <= 0.6 * full["calm_s"][request_id], (request_id, seconds, full["calm_s"])


def test_a_fair_step_target_cuts_neither_a_lone_tenant_nor_tenants_in_step():
    """A tenant alone, or two tenants holding half the seats each, run at full width: nobody is under its share
    beside a larger one, so the target does not bind."""
    for tenants in (("flood",), ("x", "y")):
        scheduler = make_scheduler(num_blocks=400, max_num_seqs=24, fair_step_ms=80.0)
        runner = FakeRunner(400, 4)
        for i in range(24):
            scheduler.add_request(_tenant_request(f"r-{i}", tenants[i % len(tenants)], 8, i * 1e-3))
        for _ in range(3):
            output, _ = step(scheduler, runner, 0.0, STEP_COST)
        assert len(output.scheduled) == 24, tenants


def test_a_flood_request_admitted_and_cut_in_the_same_step_goes_back_to_the_queue_as_it_was():
    """A flood request placed in a step and then cut entirely goes back to the queue as it was: never counted as
    started, not a preemption; it runs later, and every request completes."""
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=24, fair_step_ms=80.0)
    runner = FakeRunner(400, 4)
    for i in range(10):
        scheduler.add_request(_tenant_request(f"flood-{i}", "flood", 40, i * 1e-3))
    output, _ = step(scheduler, runner, 0.0, STEP_COST)
    assert len(output.scheduled) == 10  # one tenant: nothing to cut
    calm = _tenant_request("calm-0", "calm", 4, 1.0)
    scheduler.add_request(calm)
    late = [_tenant_request(f"flood-late-{i}", "flood", 4, 1.0 + i * 1e-3) for i in range(3)]
    for request in late:
        scheduler.add_request(request)
    output, _ = step(scheduler, runner, 1.0, STEP_COST)
    scheduled = {entry.request_id: entry.num_new_tokens for entry in output.scheduled}
    # The calm prompt whole; the flood as many tokens as it (4), its oldest rows first.
    assert scheduled == {"calm-0": 4} | {f"flood-{i}": 1 for i in range(4)}
    for request in late:
        assert request.status is RequestStatus.WAITING and request.first_scheduled_time is None
        assert request.request_id in scheduler.waiting
    run_to_completion(scheduler, runner)
    assert calm.status is RequestStatus.FINISHED_LENGTH
    assert all(request.status is RequestStatus.FINISHED_LENGTH for request in late)
    assert scheduler.num_preemptions == 0


def test_seats_left_free_beside_a_cut_flood_are_not_filled_and_emptied_at_every_step():
    """While the fair-step target cuts a flood holding most seats, the flood's waiting requests are not placed
    into the free seats only to be cut whole and put back at every step (a prefix lookup and a block allocation
    each time): after the step the calm tenants arrive in, admission passes them over until the cut lets go.
    Then they run, and nothing is lost or preempted."""
    scheduler = make_scheduler(num_blocks=1000, max_num_seqs=24, fair_step_ms=80.0)
    runner = FakeRunner(1000, 4)
    for i in range(20):
        scheduler.add_request(_tenant_request(f"flood-{i}", "flood", 60, i * 1e-3))
    now = 0.0
    for _ in range(2):
        output, _ = step(scheduler, runner, now, STEP_COST)
        now += STEP_COST[0] + STEP_COST[1] * output.num_batched_tokens
    calm = [_tenant_request(f"{tenant}-0", tenant, 16, now) for tenant in ("a", "b")]
    late = [_tenant_request(f"flood-late-{i}", "flood", 8, now + i * 1e-3) for i in range(6)]
    for request in calm + late:
        scheduler.add_request(request)
    steps_beside_calm = 0
    while any(not request.is_finished for request in calm):
        output, _ = step(scheduler, runner, now, STEP_COST)
        now += STEP_COST[0] + STEP_COST[1] * output.num_batched_tokens
        # The target (8 tokens) held throughout, but for the first step: the calm prompts (4 tokens each) and as
        # many flood tokens as one of them.
        assert output.num_batched_tokens <= (12 if steps_beside_calm == 0 else 8), output.num_batched_tokens
        steps_beside_calm += 1
    assert steps_beside_calm >= 16
    assert scheduler.num_fair_unplaced <= 2, scheduler.num_fair_unplaced  # the two free seats, once
    run_to_completion(scheduler, runner)
    assert all(request.status is RequestStatus.FINISHED_LENGTH for request in calm + late)
    assert scheduler.num_preemptions == 0
