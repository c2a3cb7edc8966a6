"""Per-request transport state and the wire records built from it (stream chunks, final records).

A request passes through two states on this side: `Pending` (decoded and admitted, waiting in the local
queue, where it can still be shed, rejected on its deadline or reordered by priority) and `InFlight` (handed
to the engine; its tokens are gathered here and flushed as chunks). Engine times are time.monotonic(); wire
timings are measured from the request record's Kafka timestamp, so they include time spent unread in Kafka.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk, Timings, Usage
from worker.engine.api import RequestOutput

REJECTED_FINISH = {"deadline": "deadline"}
"""Engine finish reasons that are rejections rather than completions."""


@dataclass(slots=True)
class Pending:
    request: GenerationRequest
    partition: object
    """The TopicPartition it came from."""
    offset: int
    priority: int
    attempt: int
    timestamp_ms: int
    deadline_ms: int | None
    reply_topic: str
    num_prompt_tokens: int
    """Estimated (admission.estimate_prompt_tokens): the tokenizer lives in the engine."""
    engine_id: str = ""
    """"<wire id>#<attempt>@<partition>:<offset>": unique in the engine even for a duplicate wire id."""

    def __post_init__(self) -> None:
        if not self.engine_id:
            partition = getattr(self.partition, "partition", self.partition)
            self.engine_id = f"{self.request.id}#{self.attempt}@{partition}:{self.offset}"


@dataclass(slots=True)
class InFlight:
    pending: Pending
    seq: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    num_unsent_tokens: int = 0
    unsent_text: list[str] = field(default_factory=list)
    last_flush: float = field(default_factory=time.monotonic)

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.num_unsent_tokens += len(out.new_token_ids)
        if out.text_delta:
            self.text_parts.append(out.text_delta)
            self.unsent_text.append(out.text_delta)

    def take_chunk(self, now: float) -> StreamChunk | None:
        """The tokens since the last chunk as one StreamChunk; None when there is nothing new."""
        if self.num_unsent_tokens == 0 and not self.unsent_text:
            return None
        chunk = StreamChunk(
            id=self.pending.request.id,
            attempt=self.pending.attempt,
            seq=self.seq,
            token_ids=self.token_ids[len(self.token_ids) - self.num_unsent_tokens:],
            text="".join(self.unsent_text),
        )
        self.seq += 1
        self.num_unsent_tokens = 0
        self.unsent_text = []
        self.last_flush = now
        return chunk


def epoch_ms(monotonic_s: float | None, now_mono: float, now_epoch_ms: float) -> float | None:
    return None if monotonic_s is None else now_epoch_ms - (now_mono - monotonic_s) * 1000.0


def _since(ms: float | None, base_ms: int) -> float | None:
    # Producer and worker clocks may disagree by a little; a negative duration is clamped, not sent.
    return None if ms is None else max(0.0, ms - base_ms)


def final_for_output(state: InFlight, out: RequestOutput, worker_id: str) -> FinalRecord:
    """The final record of a request the engine finished (completed, rejected on deadline, or error)."""
    pending = state.pending
    now_mono, now_ms = time.monotonic(), time.time() * 1000.0
    first_token_ms = epoch_ms(out.first_token_time, now_mono, now_ms)
    finish_ms = epoch_ms(out.finish_time, now_mono, now_ms) or now_ms
    tokens_per_s = None
    if out.num_output_tokens > 1 and first_token_ms is not None and finish_ms > first_token_ms:
        tokens_per_s = (out.num_output_tokens - 1) / ((finish_ms - first_token_ms) / 1000.0)
    timings = Timings(
        queue_ms=_since(epoch_ms(out.first_scheduled_time, now_mono, now_ms), pending.timestamp_ms),
        ttft_ms=_since(first_token_ms, pending.timestamp_ms),
        e2e_ms=_since(now_ms, pending.timestamp_ms),
        tokens_per_s=tokens_per_s,
    )
    usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=len(state.token_ids),
                  cached_tokens=out.num_cached_tokens)
    reason = out.finish_reason or "error"
    if reason in ("stop", "length", "abort"):
        status, finish_reason, message = "completed", reason, ""
    elif reason in REJECTED_FINISH:
        status, reason, finish_reason, message = "rejected", REJECTED_FINISH[reason], None, "deadline passed while waiting"
    else:
        status, finish_reason = "error", None
        reason, message = out.error_code or "internal", out.error_message or ""
    return FinalRecord(
        id=pending.request.id,
        attempt=pending.attempt,
        status=status,
        reason=reason,
        message=message,
        finish_reason=finish_reason,
        usage=usage,
        timings=timings,
        text="".join(state.text_parts) if status == "completed" else None,
        token_ids=list(state.token_ids) if status == "completed" else None,
        num_chunks=state.seq,
        metadata=pending.request.metadata,
        worker_id=worker_id,
    )


def answer_record(
    request_id: str, attempt: int, status: str, reason: str, message: str, timestamp_ms: int | None,
    worker_id: str, metadata: dict[str, str] | None = None,
) -> FinalRecord:
    """A final record for a request that never reached the engine (error, shed, deadline)."""
    e2e = _since(time.time() * 1000.0, timestamp_ms) if timestamp_ms is not None else None
    return FinalRecord(id=request_id, attempt=attempt, status=status, reason=reason, message=message,
                       timings=Timings(e2e_ms=e2e), metadata=metadata, worker_id=worker_id)
