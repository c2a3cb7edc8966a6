"""What a worker writes to the progress topic: how far each running request's output has been delivered, so that
the worker that takes its partition over continues the stream there instead of starting it again.

A worker with exactly-once finals writes, in the transactions of each request partition, a progress record for
every request of that partition that has delivered output (a full round every WORKER_PROGRESS_INTERVAL_MS, and
a request's first record in the next transaction that answers something after its first chunk is acknowledged).
The record holds only
what a consumer can already see: the chunks acknowledged by Kafka, their token ids and text (or, for a request
that does not stream, what it generated so far). The partition's committed offset metadata points at the
latest full round; a new owner reads from there to the end with read_committed. Keyed by request id, one
progress partition per request partition.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.limits import MAX_COMPLETIONS, MAX_INT32, MAX_SAFE_INT
from schemas.request import RequestId, TokenId, WireRecord
from schemas.result import Attempt


class CompletionProgress(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One completion's delivered output."""

    index: Annotated[int, Meta(ge=0, le=MAX_COMPLETIONS - 1)] = 0
    seq: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Chunks delivered: the resumed stream's next seq."))] = 0
    token_ids: list[TokenId] = []
    text: Annotated[str, Meta(description="The text those chunks carried (the output so far if it does not "
                                          "stream).")] = ""
    tool_call_ids: Annotated[list[str], Meta(description=(
        "Ids of the tool calls its chunks announced, in order: the resumed stream keeps them."))] = []


class ProgressRecord(WireRecord, kw_only=True, tag_field="kind", tag="progress"):
    id: RequestId
    attempt: Attempt = 0
    partition: Annotated[int, Meta(ge=0, le=MAX_INT32, description="The request record's partition.")]
    offset: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="The request record's offset.")]
    topic: Annotated[str, Meta(description="Where its chunks go (its reply topic, or the result topic).")] = ""
    completions: list[CompletionProgress] = []
    worker_id: str = ""
    ts_ms: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="When it was made, unix epoch ms.")] = 0


_DECODER = msgspec.json.Decoder(ProgressRecord)


def decode_progress(data: bytes) -> ProgressRecord:
    """Raises msgspec.DecodeError on bad input."""
    return _DECODER.decode(data)
