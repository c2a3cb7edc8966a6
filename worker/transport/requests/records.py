"""Final records, built from plain values: for a request the engine finished (`final_for_output`) and for one
answered without the engine (`answer_record`). Pure; no Kafka.

Engine times are time.monotonic(); wire timings are measured from the request record's Kafka timestamp, so
they include time spent unread in Kafka.
"""

from __future__ import annotations

import time

import msgspec

from schemas.result import FinalRecord, Timings, TokenLogprob, Usage
from schemas.tools import ToolCall
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
    cancelled: str | None = None, content: str | None = None, tool_calls: list[ToolCall] | None = None,
) -> FinalRecord:
    """The final record of a request the engine finished (completed, rejected on deadline, or error);
    `token_ids` and `text` are everything it generated, `num_chunks` the chunk records sent before it,
    `predicted` the intake's predicted queue time and completion time (ms from the record's timestamp), `logprobs`
    (when the request asked) one per token id. `cancelled`: the producer's reason ('' for none) when its request
    was cancelled: an `abort` then ends it `cancelled`, with its output so far. `content` and `tool_calls`: what
    the tool-call parser made of the text, when the request's tools may be called; a completed output that ended
    (stop) with calls finishes `tool_calls`."""
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
    if cancelled is not None and reason == "abort":
        status, reason, finish_reason = "cancelled", "cancelled", None
        message = cancel_message(cancelled, f"after {len(token_ids)} output tokens; the text so far is included")
    elif reason in ("stop", "length", "abort"):
        status, finish_reason, message = "completed", reason, ""
        if reason == "stop" and tool_calls:
            reason = finish_reason = "tool_calls"
    elif reason in REJECTED_FINISH:
        status, reason, finish_reason = "rejected", REJECTED_FINISH[reason], None
        message = (f"deadline passed after {len(token_ids)} output tokens; generation stopped, the text so far is "
                   "included" if token_ids else
                   "not started: its deadline passed, or it could not finish before it at the engine's pace")
    else:
        status, finish_reason = "error", None
        reason, message = out.error_code or "internal", out.error_message or ""
    with_output = status in ("completed", "cancelled") or (status == "rejected" and bool(token_ids))
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
        content=content if with_output else None,
        tool_calls=tool_calls if with_output else None,
        num_chunks=num_chunks,
        metadata=metadata,
        worker_id=worker_id,
    )


def cancel_message(reason: str, when: str) -> str:
    """The message of a `cancelled` final: when it stopped, and the producer's reason if it gave one."""
    return f"cancelled by its producer {when}" + (f" (reason: {reason})" if reason else "")


def answer_record(
    request_id: str, attempt: int, status: str, reason: str, message: str, timestamp_ms: int | None,
    worker_id: str, metadata: dict[str, str] | None = None,
) -> FinalRecord:
    """A final record for a request that never reached the engine (error, shed, deadline)."""
    e2e = _since(time.time() * 1000.0, timestamp_ms) if timestamp_ms is not None else None
    return FinalRecord(id=request_id, attempt=attempt, status=status, reason=reason, message=message,
                       timings=Timings(e2e_ms=e2e), metadata=metadata, worker_id=worker_id)


def slimmed(final: FinalRecord) -> FinalRecord | None:
    """The final without the next part that may be left out when it is too large for its topic (logprobs,
    then token ids), saying so in `omitted`; None when nothing is left to leave out."""
    omitted = list(final.omitted or [])
    if final.logprobs is not None:
        return msgspec.structs.replace(final, logprobs=None, omitted=[*omitted, "logprobs"])
    if final.token_ids is not None:
        return msgspec.structs.replace(final, token_ids=None, omitted=[*omitted, "token_ids"])
    return None


def group_final(finals: list[FinalRecord], num_chunks: int, predicted: tuple[float | None, float | None],
                timestamp_ms: int) -> FinalRecord:
    """The request-level final of a request with several completions, from every completion's final (the
    discarded ones of best_of too): completed when all completed (finish reason: the first completion's that is
    not `stop`, else `stop`), otherwise the status and reason of the first that did not complete. Usage counts
    the prompt once and every completion's output; no text (each completion's final has its own)."""
    first = finals[0]
    failed = next((f for f in finals if f.status != "completed"), None)
    if failed is None:
        status = "completed"
        reason = next((f.finish_reason for f in finals if f.finish_reason != "stop"), "stop")
        finish_reason, message = reason, ""
    else:
        status, reason, finish_reason = failed.status, failed.reason, None
        message = f"completion {finals.index(failed)} of {len(finals)}: {failed.message}"
    starts = [f.timings.queue_ms for f in finals if f.timings.queue_ms is not None]
    firsts = [f.timings.ttft_ms for f in finals if f.timings.ttft_ms is not None]
    return FinalRecord(
        id=first.id, attempt=first.attempt, status=status, reason=reason, message=message,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=first.usage.prompt_tokens,
                    completion_tokens=sum(f.usage.completion_tokens for f in finals),
                    cached_tokens=sum(f.usage.cached_tokens for f in finals)),
        timings=Timings(queue_ms=min(starts, default=None), ttft_ms=min(firsts, default=None),
                        e2e_ms=_since(time.time() * 1000.0, timestamp_ms),
                        predicted_queue_ms=predicted[0], predicted_e2e_ms=predicted[1]),
        num_chunks=num_chunks, metadata=first.metadata, worker_id=first.worker_id,
    )
