"""From engine outputs to result records: chunks (one per engine step, or coalesced over chunk_interval_ms),
then exactly one final record per request and attempt, whose acknowledgement marks the offset done.

Holds the `InFlight` table, the one place that knows which engine request belongs to which record. Removing
a request from it (revocation, shutdown past the drain timeout) silences it: later outputs for that engine id
are dropped, so nothing more is published for a partition this worker no longer owns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from schemas.decode import encode
from worker.engine.api import EngineRequest, RequestOutput
from worker.engine.request import SamplingParams
from worker.transport.metrics import WorkerMetrics
from worker.transport.publisher import Publisher
from worker.transport.results import InFlight, Pending, final_for_output
from worker.transport.shedding import CompletionRate

log = logging.getLogger(__name__)


def engine_request(pending: Pending) -> EngineRequest:
    req = pending.request
    s = req.sampling
    sampling = SamplingParams(
        max_new_tokens=req.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids) if s.stop_token_ids else (), stop=tuple(s.stop) if s.stop else (),
        ignore_eos=s.ignore_eos,
    )
    now_mono, now_ms = time.monotonic(), time.time() * 1000.0
    deadline = None if pending.deadline_ms is None else now_mono + (pending.deadline_ms - now_ms) / 1000.0
    return EngineRequest(
        request_id=pending.engine_id,
        prompt=req.prompt,
        messages=[{"role": m.role, "content": m.content} for m in req.messages] if req.messages else None,
        prompt_token_ids=list(req.prompt_token_ids) if req.prompt_token_ids is not None else None,
        sampling=sampling,
        priority=pending.priority,
        deadline=deadline,
        # The record's Kafka timestamp, so the engine orders by when the client asked, not when we fetched.
        arrival_time=now_mono - max(0.0, now_ms - pending.timestamp_ms) / 1000.0,
    )


class Streamer:
    def __init__(
        self, publisher: Publisher, metrics: WorkerMetrics, rate: CompletionRate, worker_id: str,
        num_priorities: int, chunk_interval_ms: float, on_done: Callable[[object, int], None],
    ) -> None:
        self.publisher = publisher
        self.metrics = metrics
        self.rate = rate
        self.worker_id = worker_id
        self.chunk_interval_s = chunk_interval_ms / 1000.0
        self.on_done = on_done
        self.inflight: dict[str, InFlight] = {}
        self.num_inflight_by_priority = [0] * num_priorities
        self.num_completed = 0
        self.num_output_tokens = 0

    def start(self, pending: Pending) -> EngineRequest:
        self.inflight[pending.engine_id] = InFlight(pending)
        self.num_inflight_by_priority[pending.priority] += 1
        return engine_request(pending)

    def forget(self, predicate: Callable[[Pending], bool]) -> list[str]:
        """Drop in-flight requests matching predicate; returns their engine ids (for engine.abort)."""
        ids = [eid for eid, st in self.inflight.items() if predicate(st.pending)]
        for eid in ids:
            self.num_inflight_by_priority[self.inflight.pop(eid).pending.priority] -= 1
        return ids

    async def handle(self, outputs: list[RequestOutput]) -> None:
        touched: dict[str, InFlight] = {}
        finals: list[tuple[InFlight, RequestOutput]] = []
        for out in outputs:
            state = self.inflight.get(out.request_id)
            if state is None:
                continue  # revoked or abandoned: its partition is someone else's now
            state.add(out)
            if out.finished:
                finals.append((state, out))
                del self.inflight[out.request_id]
                self.num_inflight_by_priority[state.pending.priority] -= 1
            else:
                touched[out.request_id] = state
        now = time.monotonic()
        for state in touched.values():
            if state.pending.request.stream and now - state.last_flush >= self.chunk_interval_s:
                self._send_chunk(state, now)
        for state, out in finals:
            self._finish(state, out, now)
        if finals:
            self.rate.record(len(finals), now)
        await self.publisher.wait_room()

    def _send_chunk(self, state: InFlight, now: float) -> None:
        chunk = state.take_chunk(now)
        if chunk is not None:
            self.publisher.publish_nowait(state.pending.reply_topic, chunk.id.encode(), encode(chunk))

    def _finish(self, state: InFlight, out: RequestOutput, now: float) -> None:
        pending = state.pending
        if pending.request.stream:
            self._send_chunk(state, now)
        final = final_for_output(state, out, self.worker_id)
        self.num_completed += 1
        self.num_output_tokens += len(state.token_ids)
        self._observe(final, out, pending)

        def acked(partition=pending.partition, offset=pending.offset) -> None:
            self.on_done(partition, offset)

        self.publisher.publish_nowait(pending.reply_topic, final.id.encode(), encode(final), acked)

    def _observe(self, final, out: RequestOutput, pending: Pending) -> None:
        m = self.metrics
        t = final.timings
        if final.status == "completed":
            m.completed_for(pending.priority).inc()
        else:
            m.rejected_for(final.reason).inc()
        if t.ttft_ms is not None:
            m.time_to_first_token.observe(t.ttft_ms / 1000.0)
        if t.queue_ms is not None:
            m.request_queue_time.observe(t.queue_ms / 1000.0)
        if t.e2e_ms is not None:
            m.e2e_request_latency.observe(t.e2e_ms / 1000.0)
        if t.tokens_per_s:
            m.inter_token_latency.observe(1.0 / t.tokens_per_s)
