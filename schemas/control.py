"""Records of the control topic (`llm.control`): what a producer tells the workers about requests it sent.

Today one kind: `CancelRecord`, key = request id (UTF-8), value `{"kind": "cancel", "id": ...}`. Every worker
reads every partition of the control topic (no consumer group), starting a lookback window back
(WORKER_CANCEL_TTL_S), so a cancel reaches whichever worker holds the request, now or after a rebalance, and
one written before the request itself still counts. A worker skips records it cannot decode (a newer kind,
say), so kinds can be added without breaking older workers.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.request import RequestId, WireRecord

MAX_CANCEL_REASON_CHARS = 256


class CancelRecord(WireRecord, kw_only=True, tag_field="kind", tag="cancel"):
    """Stop the request with this id wherever it is (local queue, engine waiting or running) and answer it with a
    `cancelled` final record carrying the text generated so far and its usage. A cancel for an id no worker
    holds, or for one already finished, changes nothing; one read before its request makes that request end
    `cancelled` at once when it arrives (within the workers' cancel TTL). Ids are not meant to be reused: a
    request sent with a cancelled id within the TTL is cancelled too."""

    id: RequestId
    reason: Annotated[
        str, Meta(max_length=MAX_CANCEL_REASON_CHARS, description="Free text, echoed in the final record's message.")
    ] = ""


ControlRecord = CancelRecord
"""Every kind of control record (a tagged union once there are more)."""
