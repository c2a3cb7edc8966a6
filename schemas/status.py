"""A worker's load report, published on the status topic about once a second (key = worker id).

Producers read it to throttle before the worker has to reject: when a priority is shed or its estimated
wait exceeds their deadline, they should slow down or route elsewhere. Partitions are request-topic
partition numbers; schemas.priority maps them to priorities.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.limits import MAX_INT32, MAX_SAFE_INT
from schemas.request import WireRecord

Count = Annotated[int, Meta(ge=0, le=MAX_SAFE_INT)]
Partition = Annotated[int, Meta(ge=0, le=MAX_INT32)]


class PriorityStatus(msgspec.Struct, kw_only=True, frozen=True):
    """The load of one priority level within this worker."""

    priority: Annotated[int, Meta(ge=0, le=255, description="0 is the most urgent.")]
    lag: Annotated[
        int,
        Meta(ge=0, le=MAX_SAFE_INT, description="Records not yet fetched (high watermark minus position) plus "
             "fetched ones not yet admitted, over this worker's partitions of the priority."),
    ] = 0
    num_waiting: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="Admitted, not yet running.")] = 0
    paused_partitions: list[Partition] = []
    shed: Annotated[bool, Meta(description="New requests of this priority are being rejected with 'shed'.")] = False
    est_wait_s: Annotated[
        float, Meta(ge=0.0, description="Estimated wait before a new request of this priority starts.")
    ] | None = None


class Throughput(msgspec.Struct, kw_only=True, frozen=True):
    """Rates over the last few seconds."""

    tokens_per_s: Annotated[float, Meta(ge=0.0, description="Generated tokens per second.")] = 0.0
    prompt_tokens_per_s: Annotated[float, Meta(ge=0.0, description="Prefilled prompt tokens per second.")] = 0.0
    requests_per_s: Annotated[float, Meta(ge=0.0, description="Final records per second.")] = 0.0


class TenantStatus(msgspec.Struct, kw_only=True, frozen=True):
    """One tenant's traffic at this worker: the top tenants by traffic each, the rest summed as "other", requests
    without a tenant as "none"."""

    tenant: Annotated[str, Meta(description="The tenant, \"other\" or \"none\".")]
    tokens_per_s: Annotated[float, Meta(ge=0.0, description="Tokens (prompt and output) served per second.")] = 0.0
    prompt_tokens: Annotated[float, Meta(ge=0.0, description="Prompt tokens served since the worker started.")] = 0.0
    output_tokens: Annotated[float, Meta(ge=0.0, description="Output tokens served since the worker started.")] = 0.0
    num_waiting: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="In the worker's local queue now.")] = 0
    num_over_quota: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Requests found over the tenant's quota since the worker started (rejected with quota_exceeded, or "
        "deferred)."))] = 0
    over_quota: Annotated[bool, Meta(description=(
        "The tenant's token bucket is empty now: its new requests are rejected (or deferred) until it refills. "
        "A producer for this tenant should slow down."))] = False
    served_by_priority: Annotated[list[float], Meta(description=(
        "Tokens (prompt and output) served to the tenant per priority (index 0 = priority 0) since the worker "
        "started. The other workers charge them to the tenant's fair share, so the fleet, not each worker "
        "alone, splits its service among tenants (docs/tenants.md)."))] = []
    in_flight_by_priority: Annotated[list[float], Meta(description=(
        "Tokens charged on entry (prompt and expected output) to the tenant's requests in the worker's engine "
        "now, per priority. With served_by_priority, the other workers charge what this one has committed to "
        "serve, not only what it finished."))] = []


class WorkerStatus(WireRecord, kw_only=True):
    """One worker's load at one moment."""

    worker_id: Annotated[str, Meta(min_length=1)]
    ts_ms: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="When measured, unix epoch milliseconds.")]
    num_waiting: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="Requests admitted, not yet running.")] = 0
    num_running: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="Requests in the running batch.")] = 0
    kv_usage: Annotated[float, Meta(ge=0.0, le=1.0, description="Fraction of KV-cache blocks in use.")] = 0.0
    priorities: Annotated[list[PriorityStatus], Meta(description="One entry per priority level.")] = []
    throughput: Throughput = msgspec.field(default_factory=Throughput)
    shedding: Annotated[bool, Meta(description="True while any priority is being shed.")] = False
    paused_partitions: Annotated[
        list[Partition], Meta(description="Request-topic partitions paused for backpressure.")
    ] = []
    assigned_partitions: Annotated[list[Partition], Meta(description="Request-topic partitions this worker owns.")] = []
    commit_waiting_partitions: Annotated[list[Partition], Meta(description=(
        "Request-topic partitions not read until their committed offset moves: the requests answered above it "
        "(requests finish out of order) fill the record of them that each exactly-once commit carries."))] = []
    num_draft_tokens: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Speculative draft tokens the engine verified since the worker started (0 with speculation off)."))] = 0
    num_accepted_draft_tokens: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Of those, the ones kept; over an interval, their share of num_draft_tokens is the acceptance rate."))] = 0
    num_preemptions: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Running requests preempted (to be recomputed) since the worker started."))] = 0
    last_step_ms: Annotated[float, Meta(ge=0.0, description="How long the engine's last step took.")] = 0.0
    num_steps: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="Engine steps since the worker started.")] = 0
    num_batched_tokens: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Tokens (prompt and output) the engine computed since the worker started."))] = 0
    busy_ms: Annotated[float, Meta(ge=0.0, description=(
        "Milliseconds the engine spent in steps since the worker started (differences over an interval give "
        "step sizes, steps per second and tokens per busy second)."))] = 0.0
    desired_workers: Annotated[float, Meta(ge=0.0, description=(
        "Workers this worker estimates the group needs to serve the offered load and the current backlog "
        "within each priority's queue-time budget, from its own partitions scaled by its share of them (an "
        "autoscaler averages it over the workers). Absent before the worker has a capacity estimate or "
        "partitions."))] | None = None
    tenants: Annotated[list[TenantStatus], Meta(description=(
        "Per tenant, most traffic first (bounded: WORKER_TENANT_MAX_LABELS named ones, then other and none)."))] = []
    allowed_reply_topics: Annotated[list[str], Meta(description=(
        "The reply topics this worker answers on besides the result topic (KAFKA_ALLOWED_REPLY_TOPICS)."
    ))] | None = None
    allowed_reply_topic_prefixes: Annotated[list[str], Meta(description=(
        "The reply-topic prefixes it allows (KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES): a client whose reply topic "
        "matches neither list learns from these that its requests would be answered on the result topic. Absent "
        "from workers that do not report them."))] | None = None
    adapters: Annotated[list[str], Meta(description=(
        "LoRA adapters this worker can serve (the folders of its ENGINE_ADAPTERS_DIR), a request's `model` names "
        "one; the gateway lists them in GET /v1/models. Absent from workers that serve none."))] | None = None
    loaded_adapters: Annotated[list[str], Meta(description=(
        "The adapters loaded now (at most ENGINE_MAX_LORAS), least recently used first: a request for another "
        "one waits for its load, milliseconds."))] | None = None
    num_adapter_loads: Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description=(
        "Adapter loads since the worker started, reloads after an eviction included: growing fast, the fleet "
        "holds too few of the adapters its traffic asks for (docs/lora.md). Absent from workers that serve "
        "none."))] | None = None
