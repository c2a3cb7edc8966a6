"""A model-free engine: "generates" deterministic tokens instantly, one per request per step.

For the plumbing benchmark (what the Kafka side sustains when compute is free) and for developing and
testing the transport without a model. No torch. It honours the Engine protocol fully: a bounded running
batch, a waiting queue served most urgent first (a more urgent request preempts the least urgent running
one), deadlines that end waiting and running requests, aborts, and stats whose
step-time model is the optional `step_time_s` delay (to emulate a slow model under overload tests).

Token t of a request is (crc32(prompt bytes) + t) % vocab_size and its text is f"<{token}>", so the same
request always gets the same output, whatever else is in the batch.
"""

from __future__ import annotations

import heapq
import time
import zlib
from dataclasses import dataclass, field

from worker.engine.api import EngineRequest, EngineStats, RequestOutput, fair_preempts


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    seed: int
    num_prompt_tokens: int
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_output_tokens: int = 0
    order: int = 0
    """Arrival order: ties within a priority, and which request a more urgent one preempts."""
    stop_at: int | None = None
    """The output count at which the request ends early (an EOS), or None: drawn once, when it arrives."""


def _prompt_bytes(request: EngineRequest) -> bytes:
    if request.prompt_token_ids is not None:
        return b",".join(str(t).encode() for t in request.prompt_token_ids)
    if request.prompt is not None:
        return request.prompt.encode("utf-8", "surrogatepass")
    text = "\n".join(f"{m['role']}:{m.get('content') or ''}" for m in request.messages or [])
    return text.encode("utf-8", "surrogatepass")


def expected_text(request: EngineRequest, vocab_size: int = 49152) -> str:
    """The text this engine produces for a request (tests compare against it)."""
    seed = zlib.crc32(_prompt_bytes(request))
    return "".join(f"<{(seed + t) % vocab_size}>" for t in range(request.sampling.max_new_tokens))


@dataclass(slots=True)
class InstantEngine:
    max_num_seqs: int = 256
    max_prompt_tokens: int = 32_768
    """Prompt "tokens" are bytes here; longer prompts end with error prompt_too_long, like the real engine."""
    step_time_s: float = 0.0
    """Sleep per step, to emulate compute."""
    vocab_size: int = 49152
    _waiting: list = field(default_factory=list)
    _running: dict[str, _Running] = field(default_factory=dict)
    _num_steps: int = 0
    _num_batched_tokens: int = 0
    _busy_s: float = 0.0
    _counter: int = 0
    _last_step_num_seqs: int = 0

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        now = time.monotonic()
        prompt = _prompt_bytes(request)
        arrival = request.arrival_time if request.arrival_time is not None else now
        if len(prompt) > self.max_prompt_tokens:
            return [RequestOutput(request.request_id, [], "", True, "error", "prompt_too_long",
                                  f"prompt has {len(prompt)} tokens, the limit is {self.max_prompt_tokens}",
                                  num_prompt_tokens=len(prompt), arrival_time=arrival, finish_time=now)]
        self._counter += 1
        state = _Running(request, zlib.crc32(prompt), max(1, len(prompt)), arrival, order=self._counter,
                         stop_at=self._stop_at(request))
        # A resumed request goes on after the tokens it delivered: token t is a function of t, so they need no
        # recompute here, and a request they already end finishes at once.
        state.num_output_tokens = len(request.resume_token_ids or ())
        if state.num_output_tokens:
            reason = self._finish_reason(state)
            if reason is not None:
                return [self._finish(state, reason)]
        heapq.heappush(self._waiting, (request.priority, request.fair_tag, self._counter, state))
        return []

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        ids = set(request_ids)
        outputs = [self._finish(s, "abort") for s in self._running.values() if s.request.request_id in ids]
        for rid in ids:
            self._running.pop(rid, None)
        kept = []
        for item in self._waiting:
            if item[-1].request.request_id in ids:
                outputs.append(self._finish(item[-1], "abort"))
            else:
                kept.append(item)
        heapq.heapify(kept)
        self._waiting = kept
        return outputs

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        expired = [rid for rid, s in self._running.items()
                   if s.request.deadline is not None and now > s.request.deadline]
        for rid in expired:
            outputs.append(self._finish(self._running.pop(rid), "deadline"))  # it stops with what it generated
        self._preempt_for_more_urgent()
        seated: list[_Running] = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            *_, state = heapq.heappop(self._waiting)
            deadline = state.request.deadline
            if deadline is not None and now > deadline:
                outputs.append(self._finish(state, "deadline"))
                continue
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            self._running[state.request.request_id] = state
            seated.append(state)
        wait = self._step_time(seated)
        if wait > 0:
            time.sleep(wait)
            now = time.monotonic()
        self._num_steps += 1
        self._last_step_num_seqs = len(self._running)
        self._num_batched_tokens += len(self._running)
        self._busy_s += wait
        finished = []
        for rid, state in self._running.items():
            token = (state.seed + state.num_output_tokens) % self.vocab_size
            state.num_output_tokens += 1
            if state.first_token_time is None:
                state.first_token_time = now
            reason = self._finish_reason(state)
            out = self._output(state, [token], f"<{token}>", reason, now)
            outputs.append(out)
            if reason is not None:
                finished.append(rid)
        for rid in finished:
            del self._running[rid]
        return outputs

    def _step_time(self, seated: list[_Running]) -> float:
        """How long this step takes, given the requests seated in it (dynamic.py charges for their prompts)."""
        return self.step_time_s

    def _stop_at(self, request: EngineRequest) -> int | None:
        """The output count at which a request stops on EOS (dynamic.py draws one); this engine never stops."""
        return None

    def _finish_reason(self, state: _Running) -> str | None:
        """After a token: why the request ends now, or None."""
        if state.stop_at is not None and state.num_output_tokens >= state.stop_at:
            return "stop"
        return "length" if state.num_output_tokens >= state.request.sampling.max_new_tokens else None

    def _preempt_for_more_urgent(self) -> None:
        """As the real scheduler does: a waiting request of a strictly more urgent priority, or of the same one and
        another tenant owed service and running far fewer (api.fair_preempts), takes the seat of the least
        urgent running one, which waits again and resumes where it was (outputs are a function of the
        token index, so nothing is recomputed)."""
        while self._waiting and len(self._running) >= self.max_num_seqs:
            victim = max(self._running.values(), key=lambda s: (s.request.priority, s.request.fair_tag, s.order))
            waiting = self._waiting[0][-1].request
            same = (s.request.tenant for s in self._running.values() if s.request.priority == waiting.priority)
            if victim.request.priority < waiting.priority or (
                    victim.request.priority == waiting.priority and not fair_preempts(waiting, victim.request, same)):
                return
            del self._running[victim.request.request_id]
            heapq.heappush(self._waiting, (victim.request.priority, victim.request.fair_tag, victim.order, victim))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            kv_usage=len(self._running) / self.max_num_seqs,
            num_steps=self._num_steps,
            num_batched_tokens=self._num_batched_tokens,
            busy_s=self._busy_s,
            last_step_num_tokens=self._last_step_num_seqs,
            last_step_num_seqs=self._last_step_num_seqs,
            step_time_base_s=self.step_time_s,
        )

    def wake_time(self) -> float | None:
        """Every waiting request is admitted at the next step (continuous batching, no windows)."""
        return time.monotonic() if self.has_unfinished() else None

    def set_input_ended(self, ended: bool = True) -> None:
        """No batch ever waits to fill here: nothing to do."""

    def _output(self, state: _Running, token_ids, text, finish_reason, now) -> RequestOutput:
        return RequestOutput(
            request_id=state.request.request_id,
            new_token_ids=token_ids,
            text_delta=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            arrival_time=state.arrival_time,
            first_scheduled_time=state.first_scheduled_time,
            first_token_time=state.first_token_time,
            finish_time=now if finish_reason is not None else None,
        )

    def _finish(self, state: _Running, reason: str) -> RequestOutput:
        return self._output(state, [], "", reason, time.monotonic())
