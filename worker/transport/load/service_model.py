"""How fast this worker serves work when it is busy, and so how long a new request will wait and run: the
estimates behind shedding (shedding.py), deadline admission (admission.py) and the status report. Pure: the
engine's numbers come in an `EngineView` snapshot (its stats, whether it is saturated, the requests in it by
priority) that the worker hands it at every turn of its loops (`see`), before anything asks for an estimate.

Unit of work: one token computed, prompt or output. The engine's step time is close to linear in the tokens a
step batches (worker/engine/step_time.py), so a request costs about its prompt + output tokens whatever else
shares its steps. A request's expected cost is its prompt estimate (4 characters a token for text, corrected
by the ratio measured on finished requests) + max_new_tokens × the measured share of max_new_tokens that
finished requests actually produced (EOS ends most chat answers early).

Capacity, in tokens per second when the engine is saturated:
- measured: prompt + output tokens of finished requests per second, an EWMA folded only over intervals during
  which the engine was saturated at both ends (requests waiting inside it, or every seat taken). An idle or
  lightly loaded worker finishes what it is given, which says nothing about what it could do, so such
  intervals are skipped instead of pulling the estimate down. Never taken below a quarter of the step-time
  model's capacity (MIN_MEASURED_FRACTION).
- before that (a cold worker): the engine's step-time model, calibrated at start-up (worker/engine/
  calibrate.py), at the step size a saturated engine runs for the average request of the backlog (P prompt
  and O output tokens): each request holds a seat for O steps (its prefill, which samples the first output
  token, then O - 1 decodes) and the batch holds max_num_seqs seats, so a step carries T =
  min(max_num_batched_tokens, max_num_seqs × (P + O) / O) tokens and capacity = T / step_time(T).

A new request's queue wait = the tokens ahead of it / capacity. Its service = its prefill step(s) + O - 1
decode steps, each at the step time of the batch it will share: n requests (those running, waiting in the
engine and ahead of it locally, and itself, at most max_num_seqs) carry T(n) = min(max_num_batched_tokens,
n × (P + O) / O) tokens a step. For n = 1 this is exact under the linear step-time model (one prefill step of
P tokens and O - 1 decode steps of one cost O × base + (P + O - 1) × per_token, P + O tokens up to one); for
n = max_num_seqs it
is the saturated step above. Counting the requests ahead, not only those running, matters on a CPU, where a
step's time grows with its tokens: a burst admitted into an idle engine soon shares full steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.engine.api import MIN_BUDGET_FRACTION, EngineStats
from worker.transport.load.shedding import CompletionRate


MIN_MEASURED_FRACTION = 0.25
"""The measured capacity is never taken below this share of the step-time model's (which follows every step the
engine times, so it tracks how fast the engine computes when it runs). Far below it the engine was not slow
but starved between steps while counted as saturated: a flood of bad records, decoded and answered on the
asyncio thread, can hold the engine thread off so that the measured rate falls far below the modelled one,
and valid requests would then be shed for the bad ones (tests/transport/test_real_traffic_kafka.py). Under
real overload the two agree within tens of percent."""


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean over observations (not time)."""

    weight: float = 0.05
    value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass(slots=True, frozen=True)
class EngineView:
    """The engine as the transport sees it at one moment."""

    stats: EngineStats = field(default_factory=EngineStats)
    saturated: bool = False
    """It cannot take more work now: requests wait inside it, or every seat is taken."""
    open_by_priority: tuple[int, ...] | None = None
    """Requests handed to the engine and not finished, per priority (the streamer's count); None: not known."""


@dataclass(slots=True)
class ServiceModel:
    num_priorities: int
    max_num_seqs: int
    max_num_batched_tokens: int
    view: EngineView = field(default_factory=EngineView)
    """The latest snapshot of the engine (`see`)."""
    rate: CompletionRate = field(default_factory=lambda: CompletionRate(half_life_s=5.0, min_seconds=1.0))
    """Tokens of finished requests per second, over saturated intervals only, once a second of them is counted."""
    prompt_ratio: Ewma = field(default_factory=Ewma)
    """Actual prompt tokens ÷ the intake's estimate, over finished requests."""
    output_ratio: Ewma = field(default_factory=Ewma)
    """Output tokens produced ÷ max_new_tokens, over completed requests."""
    _cost: list[Ewma] = field(default_factory=list)
    """Per priority: expected tokens of a request read from it."""
    tokens_read: float = 0.0
    """Expected tokens of every request read since start (the autoscaling signal's offered load, autoscale.py)."""
    _prompt: Ewma = field(default_factory=Ewma)
    _output: Ewma = field(default_factory=Ewma)
    """Expected prompt and output tokens of any request read (for the saturated step size)."""

    def __post_init__(self) -> None:
        self._cost = [Ewma() for _ in range(self.num_priorities)]

    def see(self, view: EngineView) -> None:
        """The engine now: what the estimates read until the next snapshot."""
        self.view = view

    def engine_stats(self) -> EngineStats:
        return self.view.stats

    # -- what requests cost ---------------------------------------------------------------------------
    def expected_prompt(self, estimated_prompt_tokens: int) -> float:
        return estimated_prompt_tokens * self.prompt_ratio.get(1.0)

    def expected_output(self, max_new_tokens: int) -> float:
        return max_new_tokens * self.output_ratio.get(1.0)

    def expected_cost(self, estimated_prompt_tokens: int, max_new_tokens: int, num_completions: int = 1) -> float:
        """Expected tokens of work: the prompt once (further completions take it from the prefix cache) and
        each completion's output. A request the engine will refuse at once (prompt + max_new_tokens past the
        model length; for a text prompt, by its estimate) costs nothing."""
        limit = self.engine_stats().max_model_len
        if limit and estimated_prompt_tokens + max_new_tokens > limit:
            return 0.0
        return (self.expected_prompt(estimated_prompt_tokens)
                + num_completions * self.expected_output(max_new_tokens))

    def observe_read(self, priority: int, estimated_prompt_tokens: int, max_new_tokens: int,
                     num_completions: int = 1) -> None:
        """A request read from `priority`'s partitions: the unread records behind it are priced like it."""
        cost = self.expected_cost(estimated_prompt_tokens, max_new_tokens, num_completions)
        self._cost[priority].observe(cost)
        self.tokens_read += cost
        if cost > 0:  # the step-size estimate follows requests that run
            self._prompt.observe(self.expected_prompt(estimated_prompt_tokens))
            self._output.observe(num_completions * self.expected_output(max_new_tokens))

    def mean_cost(self, priority: int) -> float | None:
        """Expected tokens of an unread request of this priority (any priority's mean before one is read)."""
        own = self._cost[priority].value
        if own is not None:
            return own
        seen = [c.value for c in self._cost if c.value is not None]
        return sum(seen) / len(seen) if seen else None

    def observe_finished(self, estimated_prompt_tokens: int, max_new_tokens: int, prompt_tokens: int,
                         output_tokens: int, completed: bool, now: float) -> None:
        """A request the engine finished. `completed`: it ran to its end (not stopped by a deadline or error),
        so its output length says how much of max_new_tokens requests use."""
        if prompt_tokens > 0 and estimated_prompt_tokens > 0:
            self.prompt_ratio.observe(prompt_tokens / estimated_prompt_tokens)
        if completed and max_new_tokens > 0:
            self.output_ratio.observe(min(1.0, output_tokens / max_new_tokens))
        self.record_tokens(prompt_tokens + output_tokens, now)

    def record_tokens(self, num_tokens: int, now: float) -> None:
        if self.view.saturated:
            self.rate.record(num_tokens, now)
        else:
            self.rate.skip(now)

    # -- speed ----------------------------------------------------------------------------------------
    def step_tokens(self, num_requests: float) -> float:
        """Tokens a step carries with num_requests requests sharing the batch (capped at max_num_seqs)."""
        prompt, output = self._prompt.get(0.0), self._output.get(0.0)
        per_seat = (prompt + output) / max(output, 1.0) if prompt + output > 0 else 1.0
        seats = max(1.0, min(float(self.max_num_seqs), num_requests))
        return max(1.0, min(float(self.max_num_batched_tokens), seats * per_seat))

    def saturated_step_tokens(self) -> float:
        return self.step_tokens(self.max_num_seqs)

    def step_time_s(self, num_tokens: float, stats: EngineStats | None = None) -> float:
        stats = stats or self.engine_stats()
        return stats.step_time_base_s + stats.step_time_per_token_s * num_tokens

    def capacity_tokens_per_s(self) -> float | None:
        """Measured while saturated, else the step-time model's; None when neither exists yet. A measured rate
        below MIN_MEASURED_FRACTION of the step-time model's is raised to it (see there)."""
        stats = self.engine_stats()
        tokens = self.saturated_step_tokens()
        step = self.step_time_s(tokens, stats)
        modelled = tokens / step if step > 0.0 else None
        measured = self.rate.rate
        if measured <= 0.0:
            return modelled
        if modelled is None:
            return measured
        return max(measured, MIN_MEASURED_FRACTION * modelled)

    def wait_s(self, tokens_ahead: float) -> float | None:
        """Seconds until a new request's first step: the step under way ends (half a step on average: the
        engine takes new requests between steps), then tokens_ahead tokens of work are served first; None
        with no estimate (nothing measured)."""
        stats = self.engine_stats()
        current = 0.5 * self.step_time_s(stats.last_step_num_tokens, stats) if stats.num_running else 0.0
        if tokens_ahead <= 0:
            return current
        capacity = self.capacity_tokens_per_s()
        return None if capacity is None else current + tokens_ahead / capacity

    def service_s(self, estimated_prompt_tokens: int, max_new_tokens: int, num_sharing: int) -> float:
        """From its first step to its last, with max_new_tokens output tokens (the longest it can run), beside
        num_sharing other requests (running, waiting in the engine, ahead of it locally)."""
        prompt = self.expected_prompt(estimated_prompt_tokens)
        # A prompt longer than the token budget is prefilled in chunks, one step each; the last samples the
        # first output token.
        prefill_steps = max(1, math.ceil(prompt / self.max_num_batched_tokens))
        num_steps = prefill_steps + max(0, max_new_tokens - 1)
        return num_steps * self.step_time_s(self.step_tokens(num_sharing + 1))

    def squeezed_service_s(self, estimated_prompt_tokens: int, max_new_tokens: int, num_sharing: int) -> float:
        """The shortest service the engine can give a protected request: its deadline-aware step sizing
        (worker/engine/scheduler.py) shrinks steps to every running request's decode, or a quarter of the token
        budget, whichever is more, when a deadline needs it."""
        prompt = self.expected_prompt(estimated_prompt_tokens)
        prefill = self.step_time_s(min(prompt, self.max_num_batched_tokens) + num_sharing)
        prefill_steps = max(1, math.ceil(prompt / self.max_num_batched_tokens))
        smallest = max(min(self.max_num_seqs, num_sharing + 1), self.max_num_batched_tokens * MIN_BUDGET_FRACTION)
        squeezed = prefill_steps * prefill + max(0, max_new_tokens - 1) * self.step_time_s(smallest)
        return min(squeezed, self.service_s(estimated_prompt_tokens, max_new_tokens, num_sharing))

    def service_for(self, queued, num_sharing: int) -> float:
        """A queued request's service for admission: the usual estimate; for a priority the engine protects
        (EngineStats.protected_priorities) with a deadline, the squeezed one (admission.py)."""
        prompt, max_new = queued.num_prompt_tokens, queued.request.max_new_tokens
        if queued.priority < self.engine_stats().protected_priorities and queued.deadline_ms is not None:
            return self.squeezed_service_s(prompt, max_new, num_sharing)
        return self.service_s(prompt, max_new, num_sharing)

    def num_sharing(self, num_ahead_locally: int = 0) -> int:
        """Requests a new one would share steps with: running, waiting in the engine, ahead of it locally."""
        stats = self.engine_stats()
        return stats.num_running + stats.num_waiting + num_ahead_locally

    def engine_waiting_by_priority(self) -> list[float]:
        """Per priority, how many of its requests in the engine wait to start: the engine's own count where
        it gives one (EngineStats.num_waiting_by_priority; priorities past the last counted at it). Requests
        wait there with seats free whenever the steps' token budget, not max_num_seqs, is what runs out: under
        overload on a CPU a third of the seats can be taken while a priority waits inside the engine, which a
        count inferred from seats does not see (its queue waits then come out several times the prediction).

        Otherwise inferred from seats: the engine seats the most urgent first and preempts less urgent ones
        for them, so priority p's requests wait only for the seats that requests of priority <= p fill:
        max(0, open(<= p) - max_num_seqs), less the same for p - 1. Without per-priority counts, the engine's
        whole waiting queue counts at priority 0."""
        counted = self.engine_stats().num_waiting_by_priority
        if counted:
            out = [float(n) for n in counted[: self.num_priorities]]
            out += [0.0] * (self.num_priorities - len(out))
            out[-1] += float(sum(counted[self.num_priorities:]))
            return out
        if self.view.open_by_priority is None:
            return [float(self.engine_stats().num_waiting)] + [0.0] * (self.num_priorities - 1)
        out, before, cumulative = [], 0.0, 0
        for n in self.view.open_by_priority:
            cumulative += n
            waiting = max(0.0, float(cumulative - self.max_num_seqs))
            out.append(waiting - before)
            before = waiting
        return out

    def engine_tokens_ahead(self, priority: int) -> float:
        """Tokens of the requests in the engine that a new request of `priority` would wait behind."""
        waiting = self.engine_waiting_by_priority()
        return sum(n * (self.mean_cost(p) or 0.0) for p, n in enumerate(waiting[:priority + 1]))
