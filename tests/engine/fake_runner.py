"""A model-free stand-in for the model runner, used by the scheduler tests.

It keeps a paged "KV cache" of (position, token id) per slot, writes each step's tokens through the slot
mapping the scheduler's output implies, reads every scheduled request's whole context back through its block
table, and asserts the context is exactly the request's tokens. So a block shared wrongly, evicted while in
use, or handed to two requests shows up as a wrong context. The next token is a function of the context read
from the cache (as a greedy model's would be), so preemption and prefix caching must not change outputs.
With a window (a model windowed on every layer, whose blocks behind the window the scheduler gives back) it
reads only the keys the step's earliest query sees, and the next token comes from the request's own tokens.
"""

from __future__ import annotations

from worker.model.settings import EngineSettings
from worker.engine.api import SamplingParams
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_output import RequestUpdate, SchedulerOutput

VOCAB_SIZE = 101
EOS = 0


def next_token(context: list[int]) -> int:
    """Deterministic "greedy model" over the context; yields EOS (0) for about one context in VOCAB_SIZE."""
    return (sum(context[-4:]) * 31 + len(context) * 7) % VOCAB_SIZE


def verify(known: list[int], drafts: list[int]) -> list[int]:
    """The drafts the greedy model agrees with, then its own token after them (as the engine keeps them)."""
    context, kept = list(known), []
    for draft in drafts:
        if next_token(context) != draft:
            break
        kept.append(draft)
        context.append(draft)
    return kept + [next_token(context)]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.num_steps = 0

    def step(self, output: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for entry in output.scheduled:
            token_ids = entry.token_ids()
            assert len(token_ids) == entry.num_new_tokens
            for pos, token_id, slot in zip(entry.positions(), token_ids, entry.slot_mapping(bs), strict=True):
                self.kv[slot] = (pos, token_id)
        sampled = {}
        for entry in output.scheduled:
            block_ids = entry.request.block_ids
            first = 0 if self.window is None else max(0, entry.num_computed_before - self.window + 1)
            assert all(block_ids[pos // bs] >= 0 for pos in range(first, entry.seq_len)), \
                f"{entry.request_id}: a block in the window was given back"
            context = [self.kv[block_ids[pos // bs] * bs + pos % bs] for pos in range(first, entry.seq_len)]
            drafts = entry.draft_token_ids or []
            known = entry.request.token_slice(0, entry.seq_len - len(drafts))
            expected = list(enumerate(known + drafts))
            assert context == expected[first:], f"{entry.request_id}: KV cache holds the wrong context"
            if drafts:
                sampled[entry.request_id] = verify(known, drafts)
            elif entry.samples:
                sampled[entry.request_id] = next_token([token_id for _, token_id in expected])
        self.num_steps += 1
        return sampled


def make_scheduler(num_blocks: int = 64, max_model_len: int = 4096, kv_window: int | None = None,
                   **settings) -> Scheduler:
    # Every field the scheduler reads is passed explicitly, so ENGINE_* variables cannot change a test.
    defaults = dict(block_size=4, max_num_batched_tokens=512, max_num_seqs=64, enable_prefix_caching=True,
                    protected_priorities=2)
    defaults |= dict(policy="continuous", max_batch_size=settings.get("max_num_seqs", 16), batch_window_ms=50.0)
    settings = defaults | settings
    return Scheduler(EngineSettings(**settings), num_blocks=num_blocks, max_model_len=max_model_len,
                     kv_window=kv_window)


def make_request(
    request_id: str,
    num_prompt_tokens: int = 8,
    max_new_tokens: int = 4,
    arrival_time: float = 0.0,
    priority: int = 0,
    prompt_token_ids: list[int] | None = None,
    **kwargs,
) -> Request:
    if prompt_token_ids is None:
        seed = sum(map(ord, request_id))
        prompt_token_ids = [1 + (seed * 13 + i * 17) % (VOCAB_SIZE - 1) for i in range(num_prompt_tokens)]
    sampling = kwargs.pop("sampling", SamplingParams(max_new_tokens=max_new_tokens))
    return Request(
        request_id,
        prompt_token_ids,
        sampling=sampling,
        priority=priority,
        arrival_time=arrival_time,
        eos_token_ids=kwargs.pop("eos_token_ids", ()),
        **kwargs,
    )


def step(scheduler: Scheduler, runner: FakeRunner, now: float = 0.0,
         step_cost: tuple[float, float] = (0.0, 0.0)) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One engine step: schedule, fake forward pass, update; checks the budget and the invariants."""
    output = scheduler.schedule(now, step_cost)
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    scheduler.check_invariants()
    updates = scheduler.update(output, runner.step(output), now)
    scheduler.check_invariants()
    return output, updates


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000, now: float = 0.0, dt: float = 0.0
) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished():
        assert len(outputs) < max_steps, "requests did not finish"
        output, _ = step(scheduler, runner, now)
        outputs.append(output)
        now += dt
    return outputs


class Simulation:
    """Operations on a scheduler driven by a FakeRunner, each followed by the checks that must hold; shared by
    the seeded random sequences and the Hypothesis state machine."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.runner = FakeRunner(scheduler.pool.num_blocks, scheduler.block_size, scheduler.pool.kv_window)
        self.now = 0.0
        self.added: list[Request] = []
        self.finished_by_caller: set[str] = set()
        self.shared_prefix = [1 + (i * 7) % (VOCAB_SIZE - 1) for i in range(32)]

    def add(
        self,
        num_shared: int,
        num_own: int,
        max_new_tokens: int,
        priority: int,
        deadline: float | None,
        stop_at_eos: bool,
    ) -> None:
        n = len(self.added)
        own = [1 + (n * 13 + i) % (VOCAB_SIZE - 1) for i in range(num_own)]
        request = make_request(
            f"r{n}",
            prompt_token_ids=(self.shared_prefix[:num_shared] + own) or [1 + n % (VOCAB_SIZE - 1)],
            max_new_tokens=max_new_tokens,
            priority=priority,
            arrival_time=self.now,
            deadline=None if deadline is None else self.now + deadline,
            eos_token_ids=(EOS,) if stop_at_eos else (),
        )
        if request.num_prompt_tokens >= self.scheduler.max_model_len:
            try:
                self.scheduler.add_request(request)
            except ValueError:
                return
            raise AssertionError("a prompt that cannot fit was accepted")
        self.scheduler.add_request(request)
        self.added.append(request)

    def step(self) -> None:
        due = self.scheduler.wake_time(self.now)
        output, updates = step(self.scheduler, self.runner, self.now)
        # The engine thread sleeps while wake_time is in the future: schedule() must then have had nothing to do,
        # and when it is due, schedule() must do something (or the thread would spin).
        did_something = not output.is_empty or bool(output.deadline_dropped)
        assert did_something == (due is not None and due <= self.now), (due, self.now, output)
        for request in output.deadline_dropped:
            # Never-run waiting requests, and requests that ran: both stop at the first step past their deadline.
            assert request.status is RequestStatus.FINISHED_DEADLINE and request.block_ids == []
            assert request.deadline is not None and request.deadline <= self.now
        for request in self.scheduler.running:
            assert request.deadline is None or request.deadline > self.now  # nothing runs past its deadline
        for update in updates:
            assert update.request.output_token_ids[-1:] == update.new_token_ids

    def advance_clock(self, dt: float) -> None:
        self.now += dt

    def finish(self, index: int, abort: bool) -> None:
        request = self.added[index % len(self.added)]
        was_finished = request.is_finished
        status = RequestStatus.FINISHED_ABORTED if abort else RequestStatus.FINISHED_STOPPED
        finished = self.scheduler.finish_requests([request.request_id], status, self.now)
        assert finished == ([] if was_finished else [request])
        if finished:
            self.finished_by_caller.add(request.request_id)
            assert request.status is status and request.block_ids == []

    def end_input(self) -> None:
        self.scheduler.set_input_ended()

    def drain(self) -> None:
        """Drive to completion; every request finishes, with the fake greedy model's own continuation."""
        self.scheduler.set_input_ended()
        for _ in range(5000):
            if not self.scheduler.has_unfinished():
                break
            step(self.scheduler, self.runner, self.now)
            self.now += 0.05  # past any dynamic window
        assert not self.scheduler.has_unfinished(), "requests did not finish"
        assert self.scheduler.pool.num_used_blocks == 0
        for request in self.added:
            assert request.is_finished, request.request_id
            context = list(request.prompt_token_ids)
            for token_id in request.output_token_ids:
                assert token_id == next_token(context), request.request_id
                context.append(token_id)
            if request.request_id in self.finished_by_caller:
                continue
            if request.status is RequestStatus.FINISHED_STOPPED:
                assert request.output_token_ids[-1] == EOS == request.stop_reason
            elif request.status is RequestStatus.FINISHED_LENGTH:
                assert (
                    request.num_output_tokens == request.sampling.max_new_tokens
                    or request.num_tokens == self.scheduler.max_model_len
                )
            else:
                # Ended at its deadline, with whatever it had generated (nothing, if it never ran).
                assert request.status is RequestStatus.FINISHED_DEADLINE and request.finish_time >= request.deadline
                assert request.num_output_tokens < request.sampling.max_new_tokens
