"""The worker settings (WORKER_*): admission, queues, shedding, streaming, tenants and fleet signals (the
process's allocator has its own, worker/allocator_settings.py). Read by every room of the transport (kafka, load,
requests), which never import each other's modules or the transport's wiring, so beside the Kafka settings
rather than inside the transport. Every field carries a docstring: docs/configuration.md is generated from them
(`llm-worker config --markdown`)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_worker_id() -> str:
    import os
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


class TenantQuota(BaseModel):
    """One tenant's token bucket: sustained rate and burst size, in tokens (prompt and output)."""

    rate_tokens_per_s: float = Field(ge=0)
    burst_tokens: float = Field(gt=0)


class WorkerSettings(BaseSettings):
    """Admission, shedding, backpressure, streaming and shutdown of `llm-worker serve`."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore", use_attribute_docstrings=True)

    worker_id: str = Field(default_factory=_default_worker_id)
    """Name in status records, final records and logs; hostname-pid by default."""
    max_waiting: int = Field(256, ge=1)
    """Local waiting-queue high watermark, per priority counting it and the more urgent ones: above it, that
    priority is no longer fetched and its partitions pause (a queue of less urgent work never pauses an
    urgent priority)."""
    resume_waiting: int = Field(128, ge=0)
    """Local waiting-queue low watermark (counted the same way): below it, paused partitions resume."""
    kv_pause_threshold: float = Field(0.95, gt=0, le=1)
    """KV-cache usage above which partitions pause."""
    kv_resume_threshold: float = Field(0.85, ge=0, le=1)
    """KV-cache usage below which paused partitions may resume."""
    max_queue_time_s: list[float] = [10.0, 30.0, 0.0]
    """Per priority: the longest estimated wait (tokens ahead / tokens per second served) before that priority's
    backlog is shed; 0: no bound, the priority is never shed for lag alone (its work waits in Kafka, paused
    partitions being the backpressure, and a request with a deadline is still refused when the estimate says it
    cannot finish in time). The most urgent priority is never shed for lag alone. The last value covers
    priorities past the list. The default leaves the bulk priority (batch jobs) unbounded: see
    docs/overload.md."""
    itl_target_ms: list[float] = [0.0, 0.0, 0.0]
    """Per priority: inter-token latency target; 0 disables latency-target admission for that priority."""
    status_interval_s: float = Field(1.0, gt=0)
    """How often the worker publishes a status record."""
    scale_arrival_window_s: float = Field(20.0, gt=0)
    """The window the offered load behind `desired_workers` (the status record's scaling signal) is measured
    over: longer is steadier against the noise of a few requests a second, shorter shows a load step sooner
    (docs/fleet.md)."""
    chunk_interval_ms: float = Field(100.0, ge=0)
    """Coalesce stream chunks for this long; 0 sends one chunk per engine step. The first token of a request
    goes out at once. On a simulated H200 running Llama-3.1-8B with 256 requests, the Kafka path reached
    0.83-0.88 of the engine alone at 20 ms (8,200 records/s), 0.84-0.91 at 50 ms (3,800-4,200/s) and
    0.85-0.93 at 100 ms (2,150-2,350/s) (benchmarks/bench_sim_kafka.py; docs/benchmarks.md); a CPU step is longer
    than 100 ms anyway. Lower it for smoother streams where the publisher has cores to spare."""
    transaction_interval_ms: float = Field(100.0, gt=0)
    """With KAFKA_EXACTLY_ONCE: how long a request partition's finals gather before they are written and
    committed in one transaction with the partition's offset. It bounds the extra time to a final for a
    read_committed reader, and how late such a reader sees chunks (it cannot read past an open transaction)."""
    progress_interval_ms: float = Field(2000.0, gt=0)
    """With exactly-once finals and a progress topic: how often each partition's transactions carry a full
    round of progress records (schemas/progress.py); a request's first one goes in the next transaction that
    answers something, or in one of its own within 0.2 s. Shorter rounds keep the tail a new owner reads back
    short, at the broker's cost."""
    destination_wait_s: float = Field(5.0, gt=0)
    """How long a topic that records are addressed to (a reply topic above all) may be absent from the broker's
    metadata, or hold a batch without an answer, before its records are answered elsewhere: a final as an
    `error`/`reply_topic_unavailable` final on the result topic, a chunk dropped. Records for other topics never
    wait on it. Allowed reply topics are checked at start-up and every `destination_check_interval_s`."""
    destination_check_interval_s: float = Field(30.0, gt=0)
    """How often the allowed reply topics are looked up again (a missing one: a WARNING line when it goes
    missing, the `reply_topic_available` gauge, and requests naming it answered at once while it stays so)."""
    io_gather_max_ms: float = Field(50.0, ge=0)
    """While the engine runs requests, the intake waits 5 % of the engine's last step (at most this long)
    between reads, and the publisher lets records gather as long before a send: fewer wake-ups of the worker's
    loop, each of which takes the core from the forward on a CPU worker. 0 reads and sends at once."""
    engine_process: bool = False
    """Run the engine core in a process of its own (worker/transport/requests/engine_process.py), as vLLM v1 and SGLang
    do, so the transport's Python never holds the engine's GIL; the worker joins its group once the engine in
    the child is built. Off: the engine runs in a thread of the worker's process."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT: how long in-flight requests may run before the worker stops without them."""
    commit_interval_s: float = Field(0.5, gt=0)
    """How often safe offsets are committed."""
    max_poll_records: int = Field(500, ge=1)
    """Records fetched per poll."""
    fetch_min_bytes: int = Field(1, ge=1)
    """Request consumer: the broker answers a fetch once this many bytes are there, or after fetch_max_wait_ms.
    1 answers at once; a few KiB batch the records of a busy topic into fewer fetches (less broker work)."""
    fetch_max_wait_ms: int = Field(500, ge=0)
    """Request consumer: the longest the broker holds a fetch waiting for fetch_min_bytes."""
    metrics_port: int = Field(9400, ge=0, le=65535)
    """Prometheus metrics HTTP port; 0 disables the endpoint."""
    pause_dwell_s: float = Field(0.5, ge=0)
    """Least time a priority's partitions stay paused or resumed before the next change (avoids churn)."""
    priority_backlog_threshold: int = Field(64, ge=0)
    """While a more urgent priority's backlog (lag + local waiting) exceeds this, less urgent ones pause."""
    session_timeout_s: float = Field(10.0, ge=1)
    """Consumer-group session timeout: how long a dead worker's partitions wait before another takes them."""
    max_clock_skew_ms: float = Field(1000.0, ge=0)
    """Queue order: a request counts as arrived at its record's timestamp, but never earlier than this long
    before the worker fetched it, so a producer whose clock runs behind cannot jump its priority's queue or
    dodge preemption. Timings in final records still start at the record's timestamp."""
    max_engine_inflight: int = Field(0, ge=0)
    """Requests handed to the engine and not finished; the rest wait in the local queue where they can still be
    shed or reordered. 0: twice the engine's max_num_seqs."""
    cancel_ttl_s: float = Field(900.0, gt=0)
    """How long a cancel counts, from its record's timestamp: a request read within it is answered `cancelled`
    at once (a cancel may come before its request, or before a rebalance moves the request here). At start a
    worker reads the control topic back this far; keep it below that topic's retention (1 hour)."""
    cancel_max_ids: int = Field(100_000, ge=1)
    """Most cancelled ids a worker remembers; past it the oldest are forgotten first."""
    cancel_sync_timeout_s: float = Field(3.0, ge=0)
    """At start, how long request intake waits for the control topic to be read up to date (so that a
    redelivered request that was cancelled is not run first); past it intake starts anyway."""
    tenant_weights: dict[str, float] = {}
    """Fair share among the tenants of a priority, by tokens served: a tenant's weight (default 1), e.g.
    {"search": 2}: backlogged, it gets twice the tokens of a tenant of weight 1 (docs/tenants.md)."""
    tenant_max_credit_tokens: float | None = Field(None, ge=0)
    """The most service (tokens) an idle tenant banks: back with requests, it starts at most this far below the
    counters of the tenants that kept the worker busy, so it cannot take the engine over for long. Unset: 2048,
    or 0 with WORKER_TENANT_FLEET_SHARE (a tenant idle here may be busy elsewhere, and a credit granted by every
    worker at every return added up to a lasting bias)."""
    tenant_contention_window_s: float = Field(30.0, gt=0)
    """Two or more tenants read at a priority within this window make a full local queue keep reading and shed
    the newest request of the tenant holding most of it (over its share), instead of pausing the priority."""
    tenant_quotas: dict[str, TenantQuota] = {}
    """Token rates per tenant: {"team-a": {"rate_tokens_per_s": 500, "burst_tokens": 4000}}; "*" is the
    default for tenants not named (requests without a tenant included). A request takes its expected tokens
    (prompt and max_new_tokens) and is corrected to those served when it ends. Empty: no quotas."""
    tenant_quota_action: Literal["reject", "defer"] = "reject"
    """Over quota: reject (rejected/quota_exceeded at once, with when the bucket refills) or defer (the request
    waits in the local queue until its bucket holds its tokens; its deadline still applies)."""
    tenant_max_labels: int = Field(10, ge=0, le=1000)
    """Tenants with a label of their own in metrics and on the status topic: the top ones by tokens read; the
    rest share "other", requests without a tenant "none"."""
    tenant_fleet_share: bool = False
    """Split the fleet's service among tenants, not each worker's alone: every worker reads the others' status
    records and charges what they served each labelled tenant to its own fair-share counters, so a tenant whose
    requests reach every partition does not get more of the fleet than one on a few (docs/tenants.md). Costs one
    consumer of the status topic per worker; the counters lag by WORKER_STATUS_INTERVAL_S. Off by default: measured
    on one shape so far (three workers, six tenants, the model-free engine)."""

    @model_validator(mode="after")
    def _check(self) -> "WorkerSettings":
        if any(not (w > 0 and math.isfinite(w)) for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights must be positive and finite")
        if self.resume_waiting > self.max_waiting:
            raise ValueError("resume_waiting must not exceed max_waiting")
        if self.kv_resume_threshold > self.kv_pause_threshold:
            raise ValueError("kv_resume_threshold must not exceed kv_pause_threshold")
        return self

    @property
    def max_credit_tokens(self) -> float:
        """tenant_max_credit_tokens, or its default: none with the fleet's counters, 2048 without."""
        if self.tenant_max_credit_tokens is not None:
            return self.tenant_max_credit_tokens
        return 0.0 if self.tenant_fleet_share else 2048.0

    def max_queue_time_for(self, priority: int) -> float:
        return self.max_queue_time_s[min(priority, len(self.max_queue_time_s) - 1)]

    def itl_target_for(self, priority: int) -> float:
        return self.itl_target_ms[min(priority, len(self.itl_target_ms) - 1)]
