"""Deadline budgeting for the scheduler: how large a step may be so that urgent running requests keep their
deadlines, and which requests cannot keep theirs any more. Pure: plain numbers and Request objects.

`step_cost` is the engine's step-time model, (base seconds, seconds per token): a step of T tokens takes about
base + per_token × T. (0, 0) means no model: the budget is always max_num_batched_tokens and only deadlines
already passed count.

Deadline-aware step size: the step's token budget shrinks, if need be, so that every running request of a
protected priority (priority < EngineSettings.protected_priorities: 0 and 1 by default) with a deadline can
still produce its remaining tokens in time, with DEADLINE_STEP_SAFETY to spare: a request with r tokens left and
s seconds to go needs steps of at most s / r. Never below `min_budget` (max(running + 1, max_num_batched_tokens
× MIN_BUDGET_FRACTION)), since small steps cost throughput (each pays the base). A request that cannot be saved
even then does not shrink the others' steps; one that can be saved there only without the margin gets steps at
that floor if it is of priority 0 (it was started on that promise), and otherwise shrinks nothing. The bulk
priority is not protected this way: it is admitted on full-size steps, and protecting every request near its
deadline would starve the batch (fewer tokens a step, so later starts, so more to protect); a deadline stops
it. On a CPU, where a step's time grows with its tokens, this keeps an urgent request within its deadline while
long prefills queue: where a full 512-token step takes 2.5 s, a request of 8 steps cannot meet a 20 s deadline
on full steps at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from worker.engine.api import MIN_BUDGET_FRACTION
from worker.engine.request import Request, RequestStatus

DEADLINE_STEP_SAFETY = 0.8
"""Deadline-aware steps aim at this share of the time a running request has left per token it has left."""

StepCost = tuple[float, float]


class DeadlinePlanner:
    """The scheduler's deadline arithmetic, given its limits; `num_running` is the running batch's size."""

    def __init__(self, max_num_batched_tokens: int, protected_priorities: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.protected_priorities = protected_priorities

    def min_budget(self, num_running: int) -> int:
        return min(self.max_num_batched_tokens,
                   max(num_running + 1, int(self.max_num_batched_tokens * MIN_BUDGET_FRACTION)))

    def smallest_step_s(self, step_cost: StepCost, num_running: int) -> float:
        """The time of the smallest step the deadline-aware sizing takes (min_budget tokens): what a request
        is started on the promise of, and what a running one cannot be saved below."""
        return step_cost[0] + step_cost[1] * self.min_budget(num_running)

    def steps_left(self, request: Request) -> int:
        """Steps a request still needs at most: one per output token left when it runs; one that waits (new or
        preempted) needs its prefill step(s) first, the last of which samples its next token."""
        left = request.sampling.max_new_tokens - request.num_output_tokens
        if request.status is not RequestStatus.RUNNING:
            left += -(-request.num_tokens // self.max_num_batched_tokens) - 1
        return left

    def budget(self, now: float, step_cost: StepCost, running: list[Request],
               protected_waiting: Iterable[Request]) -> int:
        """This step's token budget: max_num_batched_tokens, or less so that the protected requests with
        deadlines keep theirs (module docstring). Counting those that wait keeps the step that prefills an
        urgent request small too, not only the steps after it."""
        base, per_token = step_cost
        budget = self.max_num_batched_tokens
        if per_token <= 0.0:
            return budget
        floor = self.min_budget(len(running))
        smallest = self.smallest_step_s(step_cost, len(running))
        for request in itertools.chain(running, protected_waiting):
            if request.deadline is None or request.priority >= self.protected_priorities:
                continue
            left = self.steps_left(request)
            slack = request.deadline - now
            if left <= 0 or slack <= 0:
                continue
            tokens = int((slack * DEADLINE_STEP_SAFETY / left - base) / per_token)
            if tokens >= floor:
                budget = min(budget, tokens)
            elif request.priority == 0 and left * smallest <= slack:
                # The most urgent priority is started on the promise of the smallest steps without the margin
                # (cannot_finish); it keeps that promise while the margin is gone (a priority-0 request that had
                # waited 1.5 s of its 10 s was otherwise left to full 2.5 s steps and stopped as hopeless 4
                # tokens in). Other priorities get no such squeeze: below the floor they do not count, as smaller
                # steps for each would cost every other request throughput.
                budget = min(budget, floor)
        return budget

    def past_saving(self, request: Request, now: float, step_cost: StepCost, num_running: int) -> bool:
        """A request that ran cannot produce its remaining tokens by its deadline even on the smallest steps."""
        return (request.deadline is not None
                and request.deadline <= now + self.smallest_step_s(step_cost, num_running) * self.steps_left(request))

    def cannot_finish(self, request: Request, now: float, step_cost: StepCost, next_tokens: int,
                      num_running: int) -> bool:
        """A request that never ran would finish past its deadline: it is dropped instead of started. Its prefill
        and max_new_tokens steps are timed at `next_tokens` (the size the next steps will have) or, for a
        protected priority, at the smallest size deadline-aware steps go down to."""
        base, per_token = step_cost
        if request.deadline is None or base + per_token <= 0.0 or request.first_scheduled_time is not None:
            return False  # a request that ran already is judged among the running (past_saving)
        num_steps = self.steps_left(request)
        if request.priority >= self.protected_priorities:
            return now + num_steps * (base + per_token * next_tokens) > request.deadline
        # Below the most urgent priority a protected request is started only with the margin the step sizing
        # keeps: one started at the edge is likely to be stopped a few steps later, its prefill wasted; the most
        # urgent priority's deadline comes first.
        slack = request.deadline - now
        if request.priority > 0:
            slack *= DEADLINE_STEP_SAFETY
        return num_steps * self.smallest_step_s(step_cost, num_running) > slack
