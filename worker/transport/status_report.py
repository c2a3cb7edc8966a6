"""What the worker tells about its load: Prometheus gauges at every control tick, and a `WorkerStatus` record
on the status topic every status_interval_s (queue depth, KV usage, lag, paused partitions and shedding per
priority, recent throughput, per tenant), so producers can slow down a priority that is shed or paused; and the
per-tenant series on the metrics endpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from schemas.decode import encode
from schemas.status import PriorityStatus, TenantStatus, Throughput, WorkerStatus
from worker.engine.api import EngineStats
from worker.transport.load.load_control import LoadDecision
from worker.transport.load.tenant_book import WAIT_BUCKETS_S, TenantBook, TenantSnapshot
from worker.transport.metrics import NS, WorkerMetrics, cumulative_buckets
from worker.transport.kafka.publisher import Publisher

log = logging.getLogger(__name__)

PROGRESS_LOG_INTERVAL_S = 10.0
"""How often a worker with work logs one line of progress (the log is what a failed run leaves behind)."""


@dataclass(slots=True, frozen=True)
class LoadView:
    """One control tick's picture of the worker, gathered from its parts."""

    decision: LoadDecision
    stats: EngineStats
    waiting_by_priority: list[int]
    """Requests in the local queue."""
    paused_by_priority: list[list[int]]
    """Paused request partitions, by priority."""
    assigned_partitions: list[int]
    num_completed: int
    """Requests finished by the engine since start (for the throughput figures)."""
    num_output_tokens: int
    desired_workers: float | None = None
    """The autoscaling signal (autoscale.py); None while there is no estimate."""
    tenants: tuple[TenantSnapshot, ...] = ()
    commit_waiting: tuple[int, ...] = ()
    """Partitions not read until their watermark moves (Intake.commit_waiting)."""


class StatusReporter:
    def __init__(self, publisher: Publisher, metrics: WorkerMetrics, worker_id: str, status_topic: str,
                 allowed_reply_topics: list[str] | None = None,
                 allowed_reply_topic_prefixes: list[str] | None = None) -> None:
        self.allowed_reply_topics = list(allowed_reply_topics or [])
        self.allowed_reply_topic_prefixes = list(allowed_reply_topic_prefixes or [])
        self.publisher = publisher
        self.metrics = metrics
        self.worker_id = worker_id
        self.status_topic = status_topic
        self._last_status = (time.monotonic(), 0, 0)
        self._last_progress_log = (time.monotonic(), 0)

    def update_metrics(self, view: LoadView) -> None:
        m, stats = self.metrics, view.stats
        m.num_requests_waiting.set(sum(view.waiting_by_priority) + stats.num_waiting)
        m.num_requests_running.set(stats.num_running)
        m.kv_cache_usage.set(stats.kv_usage)
        m.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        m.num_preemptions.set(stats.num_preemptions)
        m.adapter_loads.set(stats.num_adapter_loads)
        m.draft_tokens.set(stats.num_draft_tokens)
        m.accepted_draft_tokens.set(stats.num_accepted_draft_tokens)
        m.desired_workers.set(view.desired_workers or 0.0)
        if stats.last_step_num_seqs:
            m.batch_size.observe(stats.last_step_num_seqs)
        for p, lag in enumerate(view.decision.lag_by_priority):
            m.consumer_lag.labels(priority=str(p)).set(lag + view.waiting_by_priority[p])
            m.paused_partitions.labels(priority=str(p)).set(len(view.paused_by_priority[p]))

    def build_status(self, view: LoadView) -> WorkerStatus:
        decision, stats = view.decision, view.stats
        now = time.monotonic()
        then, num_done_then, num_tokens_then = self._last_status
        elapsed = max(now - then, 1e-6)
        throughput = Throughput(
            tokens_per_s=(view.num_output_tokens - num_tokens_then) / elapsed,
            requests_per_s=(view.num_completed - num_done_then) / elapsed,
        )
        self._last_status = (now, view.num_completed, view.num_output_tokens)
        priorities = [
            PriorityStatus(
                priority=p, lag=decision.lag_by_priority[p] + view.waiting_by_priority[p],
                num_waiting=view.waiting_by_priority[p],
                paused_partitions=sorted(view.paused_by_priority[p]), shed=p in decision.shed_priorities,
                est_wait_s=decision.shed.est_wait_s[p],
            )
            for p in range(len(view.waiting_by_priority))
        ]
        return WorkerStatus(
            allowed_reply_topics=self.allowed_reply_topics,
            allowed_reply_topic_prefixes=self.allowed_reply_topic_prefixes,
            worker_id=self.worker_id,
            ts_ms=int(time.time() * 1000),
            num_waiting=sum(view.waiting_by_priority) + stats.num_waiting,
            num_running=stats.num_running,
            kv_usage=min(1.0, max(0.0, stats.kv_usage)),
            priorities=priorities,
            throughput=throughput,
            shedding=bool(decision.shed_priorities),
            paused_partitions=sorted(p for parts in view.paused_by_priority for p in parts),
            assigned_partitions=sorted(view.assigned_partitions),
            commit_waiting_partitions=sorted(view.commit_waiting),
            num_preemptions=stats.num_preemptions,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
            last_step_ms=max(0.0, stats.last_step_s * 1000.0),
            num_steps=stats.num_steps,
            num_batched_tokens=stats.num_batched_tokens,
            busy_ms=max(0.0, stats.busy_s * 1000.0),
            desired_workers=None if view.desired_workers is None else round(max(0.0, view.desired_workers), 3),
            tenants=[TenantStatus(tenant=t.label, tokens_per_s=round(t.tokens_per_s, 3), prompt_tokens=t.prompt_tokens,
                                  output_tokens=t.output_tokens, num_waiting=t.num_waiting,
                                  num_over_quota=t.num_over_quota, over_quota=t.over_quota,
                                  served_by_priority=[round(x, 1) for x in t.served_by_priority],
                                  in_flight_by_priority=[round(x, 1) for x in t.in_flight_by_priority])
                     for t in view.tenants],
            adapters=list(stats.adapters) if stats.adapters else None,
            loaded_adapters=list(stats.loaded_adapters) if stats.adapters else None,
            num_adapter_loads=stats.num_adapter_loads if stats.adapters else None,
        )

    async def publish(self, view: LoadView) -> None:
        status = self.build_status(view)
        self._log_progress(status, view.num_completed)
        await self.publisher.publish(self.status_topic, status.worker_id.encode(), encode(status))

    def _log_progress(self, status: WorkerStatus, num_completed: int) -> None:
        then, done_then = self._last_progress_log
        now = time.monotonic()
        if now - then < PROGRESS_LOG_INTERVAL_S:
            return
        self._last_progress_log = (now, num_completed)
        if num_completed == done_then and not (status.num_running or status.num_waiting):
            return  # idle: nothing to say
        log.info("progress: %d completed (+%d), %d running, %d waiting, kv %.2f, last step %.0f ms, "
                 "partitions %s, paused %s, shedding %s", num_completed, num_completed - done_then,
                 status.num_running, status.num_waiting, status.kv_usage, status.last_step_ms,
                 status.assigned_partitions, status.paused_partitions, status.shedding)


class TenantCollector:
    """Per-tenant series, of bounded cardinality (load/tenant_book.py: the top tenants by traffic each, the rest
    "other", requests without a tenant "none"). Read at each scrape, on the metrics server's thread, from the
    book's latest snapshot: a tuple replaced whole by the control loop, never a live table."""

    def __init__(self, registry: CollectorRegistry, book: TenantBook) -> None:
        self.book = book
        registry.register(self)

    def collect(self):
        snapshot = self.book.snapshot_now
        tokens = CounterMetricFamily(f"{NS}tenant_tokens", "Tokens served per tenant (prompt, output).",
                                     labels=["tenant", "kind"])
        finals = CounterMetricFamily(f"{NS}tenant_requests", "Final records per tenant, by status.",
                                     labels=["tenant", "status"])
        waiting = GaugeMetricFamily(f"{NS}tenant_waiting", "Requests of the tenant in the local queue.",
                                    labels=["tenant"])
        over = GaugeMetricFamily(f"{NS}tenant_over_quota", "1 while the tenant's token bucket is empty.",
                                 labels=["tenant"])
        waits = HistogramMetricFamily(
            f"{NS}tenant_wait_seconds", "Where the tenant's requests waited before their first step, by stage: "
            "kafka (record timestamp to read), local_queue (read to handed to the engine), engine (handed over "
            "to first scheduled).", labels=["tenant", "stage"])
        for t in snapshot:
            tokens.add_metric([t.label, "prompt"], t.prompt_tokens)
            tokens.add_metric([t.label, "output"], t.output_tokens)
            for status, num in sorted(t.num_finals.items()):
                finals.add_metric([t.label, status], num)
            waiting.add_metric([t.label], t.num_waiting)
            over.add_metric([t.label], float(t.over_quota))
            for stage, counts, sum_s in t.waits:
                waits.add_metric([t.label, stage], cumulative_buckets(WAIT_BUCKETS_S, counts), sum_s)
        return [tokens, finals, waiting, over, waits]

    def describe(self):
        return []
