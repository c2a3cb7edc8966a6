"""A record the worker could not serve at all, moved to the dead-letter topic so the partition moves on.

Written when a record cannot be decoded well enough to answer its sender (no usable request id), or when
it poisons the worker. The original bytes are kept verbatim (base64 in JSON) so an operator can inspect or
replay them.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.limits import MAX_INT32, MAX_SAFE_INT
from schemas.request import WireRecord


class DeadLetterRecord(WireRecord, kw_only=True):
    """The original record, where it came from and why it was set aside."""

    value: Annotated[bytes, Meta(description="The original record value, base64 in JSON.")] | None = None
    key: Annotated[bytes, Meta(description="The original record key, base64 in JSON.")] | None = None
    error_code: Annotated[str, Meta(min_length=1, description="decode_error, invalid_request, too_large, internal ...")]
    error_message: str = ""
    request_id: Annotated[str, Meta(description="The request id, when one could be read.")] | None = None
    topic: Annotated[str, Meta(min_length=1)]
    partition: Annotated[int, Meta(ge=0, le=MAX_INT32)]
    offset: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    timestamp_ms: Annotated[int, Meta(description="The original record's Kafka timestamp.")] | None = None
    dead_lettered_ms: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="When it was set aside.")] | None = None
    worker_id: str = ""
