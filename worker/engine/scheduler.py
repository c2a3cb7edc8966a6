"""The scheduler: which tokens of which requests run at each step, within a token budget (vLLM v1 style).

There are no prefill and decode phases: each request has num_computed_tokens (K/V in the cache) and
num_tokens (prompt + output), and a step computes some of the difference. One loop per step:
  1. waiting requests that never ran and whose deadline has passed are dropped (FINISHED_DEADLINE);
  2. running requests, in admission order, get min(remaining, budget left) tokens: 1 when decoding, a chunk
     when still prefilling. A request is admitted only with budget left over, so the ones still prefilling
     are always last in that order and a long prompt never stalls the others' decoding. When blocks run
     out, the running request with the largest policy key (lowest priority, latest arrival) is preempted
     by recompute, possibly the request itself;
  3. unless something was preempted, waiting requests the policy names (policies.py) are admitted in order,
     reusing prefix-cached blocks, until the budget, max_num_seqs or the blocks run out (the first one that
     does not fit blocks the ones behind it, so priorities hold). A request that never ran and cannot finish
     before its deadline is dropped instead of started (FINISHED_DEADLINE): its tokens would be wasted. Its
     prefill and max_new_tokens steps are timed by `step_cost` at the size the next steps will have (the
     running decodes and the waiting prompts, up to the budget) or, for a protected priority (below), at the
     smallest size deadline-aware steps go down to.
Deadline-aware step sizes and the deadline checks are deadlines.py's (DeadlinePlanner).
`update()` then appends the sampled tokens, advances num_computed_tokens and applies stop conditions; for a
model whose every layer has a sliding window (`kv_window`) it gives back the blocks no later query reads.
Times are time.monotonic() seconds; every method takes `now` so tests are deterministic.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from worker.model.settings import EngineSettings
from worker.engine.block_pool import BlockPool
from worker.engine.api import fair_preempts
from worker.engine.deadlines import DeadlinePlanner, StepCost
from worker.engine.policies import AdmissionPolicy, WaitingQueue
from worker.engine.request import MAX_DRAFT_TOKENS, Request, RequestStatus
from worker.engine.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput



@dataclass(slots=True)
class _FairGate:
    """Which waiting requests admission passes over while the fair-step target binds (Scheduler._fair_gate).
    The larger tenants are counted only once a step already holds the target's tokens, and once per step."""

    max_budget_left: int
    """Once the budget left is at most this, the step holds the target's tokens."""
    count_larger: Callable[[], set[tuple[int, str]]]
    larger: set[tuple[int, str]] | None = None
    contended: int = 0
    """The most urgent priority with a tenant larger than its share: less urgent ones are cut too."""

    def passes_over(self, request: Request, budget: int) -> bool:
        if budget > self.max_budget_left:
            return False
        if self.larger is None:
            self.larger = self.count_larger()
            self.contended = min((priority for priority, _ in self.larger), default=0)
        return bool(self.larger) and (
            request.priority > self.contended or (request.priority, request.tenant) in self.larger)


class Scheduler:
    def __init__(self, settings: EngineSettings, num_blocks: int, max_model_len: int,
                 kv_window: int | None = None) -> None:
        """`kv_window`: the widest layer window when every layer of the model has one (ModelConfig.kv_window);
        a request then holds only the blocks that window reaches. None: every block is kept."""
        self.block_size = settings.block_size
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self.max_num_seqs = settings.max_num_seqs
        self.max_loras = settings.max_loras
        """Distinct LoRA adapters among the running requests, at most: the runner keeps that many loaded."""
        self.lora_resident_first_steps = settings.lora_resident_first_steps
        self.loaded_adapters: Collection[str] | None = None
        """The adapters the runner holds now (the engine hands its live view of them; None without adapters):
        with every slot taken, requests whose adapter is among them go first (_defers_for_adapter)."""
        self.deadlines = DeadlinePlanner(self.max_num_batched_tokens, settings.protected_priorities)
        self.fair_step_s = settings.fair_step_ms / 1000
        """ENGINE_FAIR_STEP_MS in seconds (0: off): see _fit_fair_step."""
        # A request alone must always fit the pool, or preempting it would never help: cap its length there.
        # Under windows on every layer it holds at most its window and a step's chunk, however long it grows.
        self.max_model_len = min(max_model_len, num_blocks * settings.block_size)
        if kv_window is not None and num_blocks >= self.num_blocks_held_at_most(settings, kv_window):
            self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, settings.block_size, settings.enable_prefix_caching, kv_window)
        self.policy = AdmissionPolicy(settings.policy, settings.max_batch_size, settings.batch_window_ms / 1000)
        self.waiting = WaitingQueue(self.policy.order_key)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running."""
        self._add_order: dict[str, int] = {}
        self._num_added = 0
        self.num_preemptions = 0
        self.num_fair_unplaced = 0
        """Requests placed and then cut whole from their first step by the fair-step target (_unplace)."""
        self.num_deadline_drops = 0
        self._num_schedules = 0

    @staticmethod
    def num_blocks_held_at_most(settings: EngineSettings, kv_window: int) -> int:
        """The most blocks a request holds at once when blocks behind kv_window are given back: the kv_window - 1
        keys before its first uncomputed token, two steps' chunks of up to max_num_batched_tokens (with async
        scheduling one is in flight when the next is scheduled), and a part block at either end."""
        return -(-(2 * settings.max_num_batched_tokens + kv_window - 1) // settings.block_size) + 1

    # ---- queries ------------------------------------------------------------------------------------

    @property
    def protected_priorities(self) -> int:
        """Priorities below this keep their deadlines through smaller steps (deadlines.py)."""
        return self.deadlines.protected_priorities

    @protected_priorities.setter
    def protected_priorities(self, value: int) -> None:
        self.deadlines.protected_priorities = value

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_by_priority(self) -> tuple[int, ...]:
        """Waiting requests by priority 0 .. the largest waiting; (0,) when none wait (EngineStats reads () as
        "not counted")."""
        return self.waiting.num_by_priority()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def wake_time(self, now: float) -> float | None:
        """When schedule() next has something to do without new requests: `now` when it has work now (a
        running request, or a waiting one the policy would admit); otherwise the earlier of a dynamic window
        closing and a waiting request's deadline passing; None when neither is pending (nothing to do, or a
        static batch waiting to fill until more requests arrive or input ends)."""
        if self.running or self.policy.has_candidates(self.waiting, now):
            return now
        times = (self.policy.batch_due_time(self.waiting), self.waiting.earliest_deadline())
        return min((t for t in times if t is not None), default=None)

    # ---- requests in and out ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if not 0 < request.num_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens; "
                f"between 1 and {self.max_model_len - 1} fit"
            )
        assert request.status is RequestStatus.WAITING and not request.block_ids, request.request_id
        # Output tokens may be there already: a resumed request's, computed with its prompt like a preempted one's.
        assert request.num_computed_tokens == 0, request.request_id
        self.requests[request.request_id] = request
        self._add_order[request.request_id] = self._num_added
        self.waiting.push(request, self._num_added)
        self._num_added += 1

    def abort(self, request_ids: Iterable[str], now: float | None = None) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, now: float | None = None
    ) -> list[Request]:
        """Finish unfinished requests (waiting or running) with `status`, freeing their blocks; unknown or
        already finished ids are skipped. Returns the requests finished."""
        assert status.finished, status
        now = time.monotonic() if now is None else now
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status, now)
                finished.append(request)
        return finished

    def set_input_ended(self, ended: bool = True) -> None:
        """static policy: True when no more requests are expected for now, so a partial batch may start;
        False when requests flow again (batches wait to fill)."""
        self.policy.input_ended = ended

    # ---- one step -----------------------------------------------------------------------------------

    def schedule(self, now: float | None = None, step_cost: StepCost = (0.0, 0.0)) -> SchedulerOutput:
        """`step_cost`: (base seconds, seconds per token) of the engine's step-time model, for deadline-aware
        step sizes and for refusing to start what cannot meet its deadline ((0, 0): the budget is always
        max_num_batched_tokens, and only deadlines already passed count). The phases, in order: drop the work
        nobody can use, size the step, the running requests' tokens, then admit waiting ones."""
        now = time.monotonic() if now is None else now
        self._num_schedules += 1
        output = SchedulerOutput(block_size=self.block_size)
        self._drop_expired(now, step_cost, output)
        full_budget = budget = self.deadline_budget(now, step_cost)
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self._schedule_running(budget, scheduled, output)
        admitted: list[Request] = []
        fair = self.fair_step_s and step_cost[1] > 0
        if not output.preempted_request_ids:
            gate = self._fair_gate(step_cost, full_budget) if fair else None
            budget = self._admit_waiting(now, step_cost, budget, scheduled, output, admitted, gate)
        if fair and len(scheduled) > 1:
            budget += self._fit_fair_step(step_cost, scheduled, admitted)
        output.scheduled = list(scheduled.values())
        output.num_batched_tokens = full_budget - budget
        assert output.num_batched_tokens == sum(entry.num_new_tokens for entry in output.scheduled)
        assert len(output.scheduled) <= self.max_num_seqs
        return output

    def _drop_expired(self, now: float, step_cost: StepCost, output: SchedulerOutput) -> None:
        """Work nobody can use any more: waiting requests that never ran and whose deadline has passed; a
        request that ran (running, or preempted and waiting again) at the first step past its deadline, and a
        running one that could not produce its remaining tokens in time even on the smallest steps the engine
        takes (it would finish late, or be stopped later, its compute wasted either way). Those that ran end
        with what they generated so far."""
        expired = self.waiting.pop_expired(now)
        for request in expired:
            self._finish(request, RequestStatus.FINISHED_DEADLINE, now, in_queue=False)
        num_running = len(self.running)
        started = [r for r in self.running if self.deadlines.past_saving(r, now, step_cost, num_running)]
        if self.waiting.num_preempted_with_deadline:
            started += [r for r in self.waiting if r.status is RequestStatus.PREEMPTED and r.deadline is not None
                        and r.deadline <= now]
        for request in started:
            self._finish(request, RequestStatus.FINISHED_DEADLINE, now)
        self.num_deadline_drops += len(expired) + len(started)
        output.deadline_dropped += expired + started

    def _schedule_running(self, budget: int, scheduled: dict[str, ScheduledRequest], output: SchedulerOutput) -> int:
        """The running requests' tokens, in admission order: 1 when decoding, a chunk when still prefilling;
        preempting the least urgent when blocks run out. Returns the budget left."""
        block_size = self.block_size
        for request in list(self.running):  # the hot loop of a decode step: properties and calls inlined
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_pending_samples and self._last_token_in_flight(request):
                continue  # the step in flight samples its last token: nothing more to compute
            num_before = request.num_computed_tokens + request.num_inflight_tokens
            num_known = len(request.prompt_token_ids) + len(request.output_token_ids) + request.num_pending_samples
            num_new_tokens = min(num_known - num_before, budget)
            assert num_new_tokens > 0, request.request_id
            drafts = request.draft_token_ids
            if drafts:
                drafts = self._take_drafts(request, num_known - num_before, budget)
                num_new_tokens += len(drafts)
            if num_before + num_new_tokens <= len(request.block_ids) * block_size:
                # Its blocks already hold the step's tokens (allocate_for's first test, without the call).
                samples = num_before + num_new_tokens - len(drafts) == num_known
                request.num_inflight_tokens += num_new_tokens
                request.num_pending_samples += samples
                scheduled[request.request_id] = ScheduledRequest(request, num_new_tokens, num_before, samples,
                                                                 request.request_id, drafts or None)
                budget -= num_new_tokens
                continue
            while not self.pool.allocate_for(request, num_new_tokens, num_draft=len(drafts)):
                victim = max(self.running, key=self._victim_key)
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                unscheduled = scheduled.pop(victim.request_id, None)
                if unscheduled is not None:
                    budget += unscheduled.num_new_tokens
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._entry(request, num_new_tokens, num_before, drafts)
                budget -= num_new_tokens
        return budget

    def _defers_for_adapter(self, request: Request, running_adapters: set[str] | None) -> bool:
        """Whether `request` lets the requests behind it go first: its adapter is neither loaded nor running,
        every slot is taken (loading it evicts one that later requests may want back), it has not waited
        lora_resident_first_steps steps on that account yet, and it has no deadline (whose planning assumes
        arrival order)."""
        loaded, adapter = self.loaded_adapters, request.adapter
        if adapter is None or loaded is None or request.adapter_waits >= self.lora_resident_first_steps \
                or request.deadline is not None:
            return False
        if len(loaded) < self.max_loras or adapter in loaded:
            return False
        if running_adapters is None:
            running_adapters = {r.adapter for r in self.running if r.adapter is not None}
        return adapter not in running_adapters

    def _take_drafts(self, request: Request, num_uncomputed: int, budget: int) -> list[int]:
        """The request's speculative tokens for this step (they are cleared either way): only behind its last
        token when that is all it has to compute, within the budget and max_model_len."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if num_uncomputed != 1 or request.num_pending_samples:
            return []
        return drafts[:min(budget - 1, self.max_model_len - request.num_tokens, MAX_DRAFT_TOKENS)]

    def _admit_waiting(self, now: float, step_cost: StepCost, budget: int, scheduled: dict[str, ScheduledRequest],
                       output: SchedulerOutput, admitted: list[Request], gate: _FairGate | None = None) -> int:
        """Waiting requests the policy names, in its order, reusing prefix-cached blocks, until the budget,
        max_num_seqs or the blocks run out (the first that does not fit blocks those behind it, so priorities
        hold); one that cannot finish before its deadline is dropped instead. Those admitted are appended to
        `admitted`. While the step already holds the fair-step target's tokens (`gate`, _fair_gate), the
        requests the fair-step cut would take out are passed over. Returns the budget left."""
        hopeless: list[Request] = []
        # The size the next steps will have, for judging whether a waiting request can still finish.
        next_tokens = min(self.max_num_batched_tokens, len(self.running) + self.waiting.num_prompt_tokens
                          ) if step_cost[1] > 0 else 0
        adapters: set[str] | None = None
        deferred: list[tuple[Request, int]] = []
        """Passed over because their adapters are not loaded, with how many requests were admitted before."""
        held: list[Request] = []

        def candidates() -> Iterator[Request]:
            # Requests whose adapter would load go after the rest of their priority's run of candidates (never
            # after a less urgent one), then in their order: none waits on that account unless a request
            # behind it goes instead.
            for request in self.policy.candidates(self.waiting, now):
                if held and request.priority != held[0].priority:
                    released, held[:] = list(held), []
                    yield from released
                if self._defers_for_adapter(request, adapters):
                    deferred.append((request, len(admitted)))
                    held.append(request)
                    continue
                yield request
            yield from held

        # Without adapters, the policy's order as it is: no wrapper on every step's admission.
        for request in (candidates() if self.loaded_adapters is not None
                        else self.policy.candidates(self.waiting, now)):
            if budget == 0:
                break
            if request.adapter is not None:
                if adapters is None:
                    adapters = {r.adapter for r in self.running if r.adapter is not None}
                if request.adapter not in adapters and len(adapters) >= self.max_loras:
                    continue  # waits for an adapter's requests to finish; other adapters' and the base's go on
            if gate is not None and gate.passes_over(request, budget):
                continue  # placed now, it would be cut from the step and put back: it waits for a later one
            if self.deadlines.cannot_finish(request, now, step_cost, next_tokens, len(self.running)):
                hopeless.append(request)
                continue
            if self._leader_prefilling(request):
                continue  # its prompt's blocks are about to be in the prefix cache: take them from there
            if len(self.running) >= self.max_num_seqs:
                # Every seat taken: wait one step first, since seats free up as requests finish, and a
                # preemption costs the victim's whole recompute; preempt if none freed in that step.
                if request.seat_wait_step is None:
                    request.seat_wait_step = self._num_schedules
                if self._num_schedules == request.seat_wait_step:
                    break
                freed = self._preempt_less_urgent(request, scheduled, output)
                if freed < 0:
                    break
                budget += freed
            placed, budget = self._place(now, request, budget, scheduled, output)
            if not placed:
                break
            admitted.append(request)
            if adapters is not None and request.adapter is not None:
                adapters.add(request.adapter)
        for request, num_before in deferred:
            if len(admitted) > num_before:  # requests behind it went first
                request.adapter_waits += 1
        for request in admitted:
            self.waiting.remove(request)
        for request in hopeless:
            self.num_deadline_drops += 1
            self._finish(request, RequestStatus.FINISHED_DEADLINE, now)
            output.deadline_dropped.append(request)
        return budget

    def _place(self, now: float, request: Request, budget: int, scheduled: dict[str, ScheduledRequest],
               output: SchedulerOutput) -> tuple[bool, int]:
        """Blocks for a waiting request's first tokens (its cached prefix reused), preempting less urgent ones if
        need be; it runs from now on. Returns whether it was placed, and the budget left (which grows by what
        preempted requests held, placed or not)."""
        computed_block_ids = self.pool.get_computed_blocks(request)
        num_cached_tokens = len(computed_block_ids) * self.block_size
        num_new_tokens = min(request.num_tokens - num_cached_tokens, budget)
        while not self.pool.allocate_for(request, num_new_tokens, computed_block_ids):
            freed = self._preempt_less_urgent(request, scheduled, output)
            if freed < 0:
                return False, budget
            budget += freed
            num_new_tokens = min(request.num_tokens - num_cached_tokens, budget)
            computed_block_ids = self.pool.get_computed_blocks(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            # Prompt tokens only: a resumed request may find blocks of its earlier output too.
            request.num_cached_tokens = min(num_cached_tokens, request.num_prompt_tokens)
        scheduled[request.request_id] = self._entry(request, num_new_tokens, num_cached_tokens)
        return True, budget - num_new_tokens

    def _fit_fair_step(self, step_cost: StepCost, scheduled: dict[str, ScheduledRequest],
                       admitted: list[Request]) -> int:
        """ENGINE_FAIR_STEP_MS: when the step would last longer than the target and, at some priority, a tenant
        holding more than its equal share of the seats (max_num_seqs over the tenants running at the priority)
        runs beside one holding no more, the larger tenants' entries, and those of less urgent priorities, are
        cut to what fits the target after everything else, oldest admitted first (a prompt chunk shrinks, drafts
        go first); they still get as many tokens as the largest smaller tenant. A cut request keeps its seat and
        its KV and goes on at a later step; one admitted in this step goes back to the queue. On a device where
        a step's time grows with its batch, the smaller tenants' time per token then stays near the target while
        a flood holds most seats. Returns the tokens taken out of the step."""
        max_tokens = self._fair_step_tokens(step_cost)
        if sum(entry.num_new_tokens for entry in scheduled.values()) <= max_tokens:
            return 0
        larger = self._larger_tenants()
        if not larger:
            return 0
        contended = min(priority for priority, _ in larger)
        cut: list[ScheduledRequest] = []
        kept = 0
        smaller: Counter[str] = Counter()
        for entry in scheduled.values():
            request = entry.request
            if request.priority > contended or (request.priority, request.tenant) in larger:
                cut.append(entry)
                continue
            kept += entry.num_new_tokens
            if request.priority == contended:
                smaller[request.tenant] += entry.num_new_tokens
        room = max(max_tokens - kept, max(smaller.values(), default=1))
        placed_now = {request.request_id for request in admitted}
        removed = 0
        cut.sort(key=lambda entry: entry.request.priority)  # stable: admission order within a priority
        for entry in cut:
            num_tokens = entry.num_new_tokens
            if num_tokens <= room:
                room -= num_tokens
                continue
            request = entry.request
            keep = 0
            if entry.draft_token_ids:
                keep = num_tokens - len(entry.draft_token_ids)
                keep = keep if keep <= room else 0
            elif room and num_tokens > 1:
                keep = room  # a prompt chunk: the rest comes at a later step
            removed += num_tokens - keep
            request.num_inflight_tokens -= num_tokens - keep
            if not keep:
                request.num_pending_samples -= entry.samples
                del scheduled[entry.request_id]
                if entry.request_id in placed_now:
                    self._unplace(request)
                continue
            room -= keep
            samples = entry.samples and bool(entry.draft_token_ids)
            request.num_pending_samples -= entry.samples and not samples
            scheduled[entry.request_id] = ScheduledRequest(request, keep, entry.num_computed_before, samples,
                                                           entry.request_id)
        return removed

    def _fair_step_tokens(self, step_cost: StepCost) -> int:
        """The tokens a step holds within ENGINE_FAIR_STEP_MS under the step-time model."""
        base, per_token = step_cost
        return max(1, int((self.fair_step_s - base) / per_token))

    def _larger_tenants(self) -> set[tuple[int, str]]:
        """(priority, tenant) of the running tenants holding more than their equal share of the seats at a
        priority where another tenant holds no more than its own."""
        seats: dict[int, Counter[str]] = {}
        for request in self.running:
            seats.setdefault(request.priority, Counter())[request.tenant] += 1
        larger: set[tuple[int, str]] = set()
        for priority, counts in seats.items():
            share = self.max_num_seqs / len(counts)
            over = [tenant for tenant, num in counts.items() if num > share]
            if over and len(over) < len(counts):
                larger.update((priority, tenant) for tenant in over)
        return larger

    def _fair_gate(self, step_cost: StepCost, full_budget: int) -> _FairGate:
        """What admission needs to pass over the requests the fair-step cut would take out again (a prefix
        lookup and a block allocation each, undone, at every step while the cut applies and seats are free)."""
        return _FairGate(full_budget - self._fair_step_tokens(step_cost), self._larger_tenants)

    def _unplace(self, request: Request) -> None:
        """Undo the admission of a request placed in this step and given no tokens after all: back to the queue
        as it was (not a preemption: nothing of it was computed)."""
        self.num_fair_unplaced += 1
        self.pool.free(request)
        self.running.remove(request)
        request.num_computed_tokens = request.num_inflight_tokens = request.num_pending_samples = 0
        if request.num_preemptions:
            request.status = RequestStatus.PREEMPTED
        else:
            request.status = RequestStatus.WAITING
            request.first_scheduled_time = None
            request.num_cached_tokens = 0
        self.waiting.push(request, self._add_order[request.request_id])

    def deadline_budget(self, now: float, step_cost: StepCost) -> int:
        """This step's token budget (deadlines.py): max_num_batched_tokens, or less so that the protected
        running and waiting requests with deadlines keep theirs."""
        waiting = self._protected_waiting() if self.waiting.any_with_deadline_below(self.protected_priorities) else ()
        return self.deadlines.budget(now, step_cost, self.running, waiting)

    def _protected_waiting(self) -> Iterable[Request]:
        """Waiting requests of the protected priorities; the queue is in priority order except under the static
        policy, so the less urgent rest is not walked at every step."""
        for request in self.waiting:
            if request.priority >= self.protected_priorities and self.policy.name != "static":
                return
            yield request

    def _leader_prefilling(self, request: Request) -> bool:
        """Whether `request` waits for its prefix leader (a sibling completion of the same prompt) to compute
        the prompt first; not once the leader has finished or is gone, nor without a prefix cache."""
        if request.prefix_leader is None or not self.pool.enable_caching:
            return False
        leader = self.requests.get(request.prefix_leader)
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def min_budget(self) -> int:
        return self.deadlines.min_budget(len(self.running))

    def update(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], now: float | None = None
    ) -> list[RequestUpdate]:
        """Apply a finished step: advance num_computed_tokens, append one sampled token per sampling request,
        check stop conditions, free finished requests. Requests finished since schedule() are skipped."""
        now = time.monotonic() if now is None else now
        # The loop of a decode step: it runs for every running request, so properties are inlined.
        caching = self.pool.enable_caching
        window = self.pool.kv_window
        block_size = self.block_size
        running = RequestStatus.RUNNING
        num_consumed = 0
        updates = []
        for entry in output.scheduled:
            request = entry.request
            if request.status is not running:
                num_consumed += entry.samples and entry.request_id in sampled_token_ids
                continue
            num_new = entry.num_new_tokens
            assert request.num_computed_tokens == entry.num_computed_before, request.request_id
            if entry.draft_token_ids:
                num_consumed += 1
                request.num_inflight_tokens -= num_new
                request.num_pending_samples -= 1
                updates.append(self._apply_verified(entry, sampled_token_ids[entry.request_id], now))
                continue
            request.num_computed_tokens = num_computed = request.num_computed_tokens + num_new
            request.num_inflight_tokens -= num_new
            if caching and num_computed % block_size < num_new:  # a block filled up in this step
                self.pool.cache_full_blocks(request)
            # After caching, so a full block leaving the window stays in the prefix cache.
            if window is not None and (num_computed - window + 1) // block_size > request.num_freed_blocks:
                self.pool.free_outside_window(request)
            if not entry.samples:
                continue
            request.num_pending_samples -= 1
            token_id = sampled_token_ids[entry.request_id]
            num_consumed += 1
            request.output_token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            finish_status = self._ends_with(request, token_id)
            if finish_status is None:
                updates.append(RequestUpdate(request, [token_id], None))
                continue
            self._finish(request, finish_status, now)
            updates.append(RequestUpdate(request, [token_id], finish_status))
        if num_consumed != len(sampled_token_ids):  # a token for a request this step did not sample
            sampling_ids = {entry.request_id for entry in output.scheduled if entry.samples}
            raise AssertionError(set(sampled_token_ids) - sampling_ids)
        return updates

    def _apply_verified(self, entry: ScheduledRequest, token_ids: list[int], now: float) -> RequestUpdate:
        """A step that verified drafts: `token_ids` are the drafts the model agreed with, then its own token after
        them. The K/V of the request's last token and of the accepted drafts are computed; those of rejected drafts
        sit past num_computed_tokens, written over when those positions are computed again. Stop conditions apply
        token by token, as if each had come from a step of its own; tokens after a stop are dropped."""
        request = entry.request
        finish_status = None
        for i, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            finish_status = self._ends_with(request, token_id)
            if finish_status is not None:
                token_ids = token_ids[:i + 1]
                break
        request.num_computed_tokens = entry.num_computed_before + len(token_ids)
        if self.pool.enable_caching:
            self.pool.cache_full_blocks(request)
        if self.pool.kv_window is not None:
            self.pool.free_outside_window(request)
        if request.first_token_time is None:
            request.first_token_time = now
        if finish_status is not None:
            self._finish(request, finish_status, now)
        return RequestUpdate(request, list(token_ids), finish_status)

    def _ends_with(self, request: Request, token_id: int) -> RequestStatus | None:
        """How `token_id`, just appended to the request's output, ends it (a stop or EOS token, whose id becomes
        its stop_reason; max_new_tokens; max_model_len), or None when it goes on."""
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (not sampling.ignore_eos and token_id in request.eos_token_ids):
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        num_output = len(request.output_token_ids)
        if num_output >= sampling.max_new_tokens or len(request.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_invariants(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        running_ids = {request.request_id for request in self.running}
        waiting_ids = {request.request_id for request in self.waiting}
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert not running_ids & waiting_ids and running_ids | waiting_ids == self.requests.keys()
        assert len({r.adapter for r in self.running if r.adapter is not None}) <= self.max_loras
        for request in self.running:
            assert request.status is RequestStatus.RUNNING and request.block_ids, request.request_id
            assert request.num_computed_tokens < request.num_tokens <= self.max_model_len, request.request_id
            assert self.policy.name == "continuous" or self.policy.in_batch(request), request.request_id
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.request_id
            assert not request.block_ids and request.num_computed_tokens == 0, request.request_id
        self.waiting.check_counts()
        self.pool.check_invariants(self.running)

    # ---- internals ----------------------------------------------------------------------------------

    def _last_token_in_flight(self, request: Request) -> bool:
        """Whether the token a step in flight samples for `request` is its last (max_new_tokens or
        max_model_len): scheduling it again would compute a token nobody reads."""
        return (request.num_output_tokens + request.num_pending_samples >= request.sampling.max_new_tokens
                or request.num_known_tokens >= self.max_model_len)

    def _entry(self, request: Request, num_new_tokens: int, num_computed_before: int,
               drafts: list[int] | None = None) -> ScheduledRequest:
        """The request's share of this step, counted as in flight until update() (a preemption later in the
        same schedule() resets the counts with the rest)."""
        samples = num_computed_before + num_new_tokens - len(drafts or ()) == request.num_known_tokens
        request.num_inflight_tokens += num_new_tokens
        request.num_pending_samples += samples
        return ScheduledRequest(request, num_new_tokens, num_computed_before, samples, request.request_id,
                                drafts or None)

    def _preempt_less_urgent(self, request: Request, scheduled: dict[str, ScheduledRequest],
                             output: SchedulerOutput) -> int:
        """continuous policy: make room for `request` by preempting the least urgent running request, if it is
        of a strictly less urgent priority, or of the same priority and another tenant far above its fair share
        (api.fair_preempts; otherwise never within a priority: that would only trade places). Returns the
        token budget the victim had been given this step (0 if it was not scheduled yet), or -1 when there is
        no such victim. A more urgent request thus never waits behind less urgent work for KV blocks beyond the
        step it arrives in, nor for a seat (max_num_seqs) beyond the step after: for a seat it first waits one
        step, in which finishing requests usually free one, since preempting costs the victim's recompute."""
        if self.policy.name != "continuous" or not self.running:
            return -1
        victim = max(self.running, key=self._victim_key)
        if victim.priority < request.priority or (victim.priority == request.priority and not fair_preempts(
                request, victim, (r.tenant for r in self.running if r.priority == request.priority))):
            return -1
        self._preempt(victim)
        output.preempted_request_ids.append(victim.request_id)
        unscheduled = scheduled.pop(victim.request_id, None)
        return unscheduled.num_new_tokens if unscheduled is not None else 0

    def _victim_key(self, request: Request) -> tuple:
        return (self.policy.order_key(request), self._add_order[request.request_id])

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the K/V, keep the output tokens; on resume prompt + output is recomputed
        (its full blocks usually still sit in the prefix cache)."""
        self.pool.free(request)
        self.running.remove(request)
        request.num_computed_tokens = request.num_inflight_tokens = request.num_pending_samples = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, self._add_order[request.request_id])

    def _finish(self, request: Request, status: RequestStatus, now: float, in_queue: bool = True) -> None:
        if request.status is RequestStatus.RUNNING:
            self.pool.free(request)
            self.running.remove(request)
        elif in_queue:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = now
        del self.requests[request.request_id]
        del self._add_order[request.request_id]
