"""What a worker writes to the reply topic for each request: stream chunks, then exactly one final record.

Both carry `kind` as a msgspec tag, so a consumer decodes `StreamChunk | FinalRecord` in one call
(decode.decode_result). Records are keyed by request id, so one request's records share a partition and
arrive in order. A redelivered request is served again under a higher `attempt`: a client that sees a higher
attempt than the stream it is assembling drops what it had and starts over, unless the records of that attempt
carry `resumed_at` (the stream was resumed where its earlier worker left it: keep the chunks below that seq).

`reason` and `finish_reason` are open sets of codes: a client should treat a code it does not know like
"internal". The codes in use are listed below.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.limits import MAX_COMPLETIONS, MAX_INT32, MAX_SAFE_INT
from schemas.request import RequestId, TokenId, WireRecord
from schemas.tools import ToolCall, ToolCallDelta

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
"""stop: EOS, a stop token or a stop string; length: max_new_tokens or the context end; abort: cancelled;
tool_calls: the output ended (as for stop) and holds tool calls."""
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "tool_calls")

REJECT_REASONS: tuple[str, ...] = ("deadline", "shed", "overloaded", "queue_full")
"""rejected: the request was valid but not served. deadline: it expired before it could start; shed: its
priority is being shed under load; overloaded: the worker cannot take more now; queue_full: the waiting
queue is at its bound."""

ERROR_REASONS: tuple[str, ...] = (
    "invalid_request",
    "too_large",
    "prompt_too_long",
    "reply_topic_not_allowed",
    "reply_topic_unavailable",
    "result_too_large",
    "decode_error",
    "internal",
)
"""error: the request cannot be served as sent (all but internal) or the worker failed (internal).
reply_topic_unavailable: its reply topic is allowed but missing or not writable (the final then comes on the
result topic); result_too_large: its final record does not fit the topic's record limit even without the parts
that may be omitted (see FinalRecord.omitted)."""

CANCEL_REASONS: tuple[str, ...] = ("cancelled",)
"""cancelled: its producer cancelled it (a cancel record on the control topic, schemas/control.py); the final
carries the text and token ids generated so far (empty when it never ran) and their usage."""

Attempt = Annotated[
    int,
    Meta(
        ge=0,
        le=MAX_INT32,
        description="Grows with every redelivery of the request (the consumer-group generation that served it); "
        "a higher attempt supersedes a lower one.",
    ),
]
Count = Annotated[int, Meta(ge=0, le=MAX_SAFE_INT)]
ResumedAt = Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
    "Set on every record of an attempt that continued the stream of an earlier attempt (its worker went away "
    "mid-stream): the seq at which this attempt took over. The chunks of earlier attempts with a lower seq "
    "stand and are not sent again; drop those with this seq or higher. Absent: the attempt starts the stream "
    "from seq 0 (a restart drops everything of earlier attempts)."))] | None


class TopLogprob(msgspec.Struct, kw_only=True, frozen=True):
    token_id: TokenId
    logprob: Annotated[float, Meta(description="<= 0; a masked token's -inf is sent as -3.4028235e38.")]


class TokenLogprob(msgspec.Struct, kw_only=True, frozen=True):
    """One output token's log-probability under the model's distribution after penalties and min_tokens, before
    temperature, top_k and top_p (so a sampled token's value does not depend on them)."""

    token_id: TokenId
    logprob: Annotated[float, Meta(description="<= 0; a masked token's -inf is sent as -3.4028235e38.")]
    top_logprobs: Annotated[
        list[TopLogprob], Meta(description="The sampling.top_logprobs most likely tokens, most likely first.")
    ] = []


class StreamChunk(WireRecord, kw_only=True, tag_field="kind", tag="chunk"):
    """New tokens of one request since its previous chunk."""

    id: RequestId
    attempt: Attempt = 0
    seq: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="0, 1, 2, ... within one attempt (and index).")]
    index: Annotated[int, Meta(ge=0, le=MAX_COMPLETIONS - 1, description=(
        "Which completion (0 to n-1) of a request with n > 1; each has its own seq."))] = 0
    token_ids: list[TokenId] = []
    text: Annotated[str, Meta(description="Text delta; may be empty while a multi-byte character is pending.")] = ""
    logprobs: Annotated[
        list[TokenLogprob], Meta(description="With sampling.logprobs: one per token id, in the same order.")
    ] | None = None
    content: Annotated[str, Meta(description=(
        "Set when the request's tools may be called (tool_choice not none): the part of the text delta outside "
        "tool calls. Text that may begin a call is held back until it is known not to."))] | None = None
    tool_calls: Annotated[list[ToolCallDelta], Meta(description=(
        "Pieces of the tool calls parsed so far (OpenAI's delta.tool_calls): joined by index they make the "
        "final record's tool_calls."))] | None = None
    resumed_at: ResumedAt = None


class Usage(msgspec.Struct, kw_only=True, frozen=True):
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_tokens: Annotated[
        int, Meta(ge=0, le=MAX_SAFE_INT, description="Prompt tokens found in the prefix cache.")
    ] = 0


class Timings(msgspec.Struct, kw_only=True, frozen=True):
    """Milliseconds; null where the request never reached that point (a rejected one has only e2e_ms)."""

    queue_ms: Annotated[float, Meta(ge=0.0, description="Record timestamp to first scheduled.")] | None = None
    ttft_ms: Annotated[float, Meta(ge=0.0, description="Record timestamp to first output token.")] | None = None
    e2e_ms: Annotated[float, Meta(ge=0.0, description="Record timestamp to final record.")] | None = None
    tokens_per_s: Annotated[float, Meta(ge=0.0, description="Output tokens per second after the first.")] | None = None
    predicted_queue_ms: Annotated[float, Meta(ge=0.0, description=(
        "The worker's prediction, when it read the record, of queue_ms."))] | None = None
    predicted_e2e_ms: Annotated[float, Meta(ge=0.0, description=(
        "The worker's prediction, when it read the record, of the time from the record timestamp to the last "
        "token if the request runs to max_new_tokens."))] | None = None


class FinalRecord(WireRecord, kw_only=True, tag_field="kind", tag="final"):
    """The last record of a request: how it ended, usage and timings."""

    id: RequestId
    attempt: Attempt = 0
    status: Literal["completed", "rejected", "error", "cancelled"]
    reason: Annotated[
        str,
        Meta(
            min_length=1,
            description="completed: the finish reason. rejected: deadline, shed, overloaded, queue_full, "
            "quota_exceeded (the tenant's token quota; the message says when it refills). "
            "error: invalid_request, too_large, prompt_too_long, reply_topic_not_allowed, "
            "reply_topic_unavailable, result_too_large, decode_error, poison_request, internal. "
            "cancelled: cancelled (text and token_ids hold the output so far). "
            "Treat an unknown code like internal.",
        ),
    ]
    message: Annotated[str, Meta(description="Human-readable detail.")] = ""
    finish_reason: FinishReason | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    text: Annotated[str, Meta(description="The whole output text; always set when stream is false.")] | None = None
    token_ids: Annotated[list[TokenId], Meta(description="The whole output; set with text.")] | None = None
    logprobs: Annotated[
        list[TokenLogprob], Meta(description="With sampling.logprobs: one per token id of token_ids, in order.")
    ] | None = None
    num_chunks: Annotated[
        int, Meta(ge=0, le=MAX_SAFE_INT, description=(
            "Chunks of the stream, so a client can tell it saw all: those of this attempt, and with resumed_at "
            "the resumed_at chunks before them."))
    ] = 0
    content: Annotated[str, Meta(description=(
        "Set when the request's tools may be called (tool_choice not none): the text outside tool calls, "
        "trimmed; `text` keeps the whole output."))] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(description=(
        "The calls the output holds, in order; finish_reason is then tool_calls."))] | None = None
    metadata: dict[str, str] | None = None
    worker_id: str = ""
    retry_after_ms: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "On a rejection that waiting cures (quota_exceeded): how long until the same request would be "
        "accepted."))] | None = None
    omitted: Annotated[list[Literal["logprobs", "token_ids"]], Meta(description=(
        "Parts of the output left out of this record because with them it would exceed the topic's record limit "
        "(max.message.bytes); the stream's chunks carried them. Text and usage are never omitted."))] | None = None
    index: Annotated[int, Meta(ge=0, le=MAX_COMPLETIONS - 1, description=(
        "Set on the final of one completion of a request with n > 1 or best_of > 1; that request ends with "
        "one more final without index (its usage and num_chunks count every completion). A final without "
        "index is the request's last record."))] | None = None
    resumed_at: ResumedAt = None

    def __post_init__(self) -> None:
        # A final record that contradicts itself is a worker bug; refuse it at both ends.
        if self.status == "completed":
            if self.finish_reason is None or self.reason != self.finish_reason:
                raise ValueError("a completed record needs finish_reason, and reason equal to it")
        elif self.finish_reason is not None:
            raise ValueError(f"a {self.status} record has no finish_reason")


ResultRecord = StreamChunk | FinalRecord
