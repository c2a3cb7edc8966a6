"""What a worker writes to the usage topic: one record per request, for billing and capacity reports.

Each request's final record has a usage record beside it, keyed by the request id. With exactly-once finals
(KAFKA_EXACTLY_ONCE, the default) both go in the same transaction as the request's offset, so a consumer that
reads the usage topic with isolation.level=read_committed counts every request exactly once, across crashes,
rebalances and zombies: the sum of its records equals the sum of the usage of the finals a read_committed
reader of the result topic sees. Without exactly-once there is one per attempt, like the finals: keep the
highest attempt of each id. `llm-worker usage report` sums them per tenant and priority.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from schemas.limits import MAX_INT32, MAX_SAFE_INT
from schemas.request import RequestId, WireRecord
from schemas.result import Attempt, Count


class UsageRecord(WireRecord, kw_only=True, tag_field="kind", tag="usage"):
    """One request's usage, as its final record reports it."""

    id: RequestId
    attempt: Attempt = 0
    tenant: Annotated[str, Meta(description="The request's tenant; empty when it named none.")] = ""
    priority: Annotated[int, Meta(ge=0, le=MAX_INT32, description="Its priority (from its request partition).")] = 0
    model: Annotated[str, Meta(description="The model that served it.")] = ""
    status: Literal["completed", "rejected", "error", "cancelled"]
    reason: Annotated[str, Meta(description="The final record's reason.")] = ""
    prompt_tokens: Count = 0
    cached_tokens: Count = 0
    completion_tokens: Count = 0
    queue_ms: Annotated[float, Meta(ge=0.0)] | None = None
    ttft_ms: Annotated[float, Meta(ge=0.0)] | None = None
    e2e_ms: Annotated[float, Meta(ge=0.0)] | None = None
    worker_id: str = ""
    ts_ms: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="When the final was made, unix epoch ms.")] = 0
