"""Final records, built from plain values: for a request the engine finished (`final_for_output`) and for one
answered without the engine (`answer_record`). Pure; no Kafka.

Engine times are time.monotonic(); wire timings are measured from the request record's Kafka timestamp, so
they include time spent unread in Kafka.
"""

from __future__ import annotations

import time

from schemas.result import FinalRecord, Timings, TokenLogprob, Usage
from worker.engine.api import RequestOutput

REJECTED_FINISH = {"deadline": "deadline"}
"""Engine finish reasons that are rejections rather than completions."""


def epoch_ms(monotonic_s: float | None, now_mono: float, now_epoch_ms: float) -> float | None:
    return None if monotonic_s is None else now_epoch_ms - (now_mono - monotonic_s) * 1000.0


def _since(ms: float | None, base_ms: int) -> float | None:
    # Producer and worker clocks may disagree by a little; a negative duration is clamped, not sent.
    return None if ms is None else max(0.0, ms - base_ms)


def final_for_output(
    request_id: str, attempt: int, timestamp_ms: int, metadata: dict[str, str] | None, out: RequestOutput,
    token_ids: list[int], text: str, num_chunks: int, worker_id: str,
    predicted: tuple[float | None, float | None] = (None, None), logprobs: list[TokenLogprob] | None = None,
) -> FinalRecord:
    """The final record of a request the engine finished (completed, rejected on deadline, or error);
    `token_ids` and `text` are everything it generated, `num_chunks` the chunk records sent before it,
    `predicted` the intake's predicted queue time and completion time (ms from the record's timestamp), `logprobs`
    (when the request asked) one per token id."""
    now_mono, now_ms = time.monotonic(), time.time() * 1000.0
    first_token_ms = epoch_ms(out.first_token_time, now_mono, now_ms)
    finish_ms = epoch_ms(out.finish_time, now_mono, now_ms) or now_ms
    tokens_per_s = None
    if out.num_output_tokens > 1 and first_token_ms is not None and finish_ms > first_token_ms:
        tokens_per_s = (out.num_output_tokens - 1) / ((finish_ms - first_token_ms) / 1000.0)
    timings = Timings(
        queue_ms=_since(epoch_ms(out.first_scheduled_time, now_mono, now_ms), timestamp_ms),
        ttft_ms=_since(first_token_ms, timestamp_ms),
        e2e_ms=_since(now_ms, timestamp_ms),
        tokens_per_s=tokens_per_s,
        predicted_queue_ms=predicted[0],
        predicted_e2e_ms=predicted[1],
    )
    usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=len(token_ids),
                  cached_tokens=out.num_cached_tokens)
    reason = out.finish_reason or "error"
    if reason in ("stop", "length", "abort"):
        status, finish_reason, message = "completed", reason, ""
    elif reason in REJECTED_FINISH:
        status, reason, finish_reason = "rejected", REJECTED_FINISH[reason], None
        message = (f"deadline passed after {len(token_ids)} output tokens; generation stopped, the text so far is "
                   "included" if token_ids else
                   "not started: its deadline passed, or it could not finish before it at the engine's pace")
    else:
        status, finish_reason = "error", None
        reason, message = out.error_code or "internal", out.error_message or ""
    with_output = status == "completed" or (status == "rejected" and bool(token_ids))
    return FinalRecord(
        id=request_id,
        attempt=attempt,
        status=status,
        reason=reason,
        message=message,
        finish_reason=finish_reason,
        usage=usage,
        timings=timings,
        text=text if with_output else None,
        token_ids=list(token_ids) if with_output else None,
        logprobs=list(logprobs) if with_output and logprobs is not None else None,
        num_chunks=num_chunks,
        metadata=metadata,
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
