"""Prometheus metrics of one worker, named after vLLM's where they mean the same thing.

vLLM uses the `vllm:` namespace (':' is legal in Prometheus metric names); we use `llm_worker:`. Every
worker has its own CollectorRegistry rather than the process-global one, so tests can run several workers
in one process. Counters get prometheus_client's `_total` suffix in the exposition.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

NS = "llm_worker:"
# Latency buckets from 1 ms to 5 min: CPU decode steps are tens of ms, queueing under overload is minutes.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def cumulative_buckets(bounds, counts) -> list[tuple[str, int]]:
    """Prometheus' buckets (le, cumulative count) of per-bound counts whose last slot is +Inf."""
    out, running = [], 0
    for bound, count in zip([*bounds, float("inf")], counts):
        running += count
        out.append((str(float(bound)) if bound != float("inf") else "+Inf", running))
    return out


class BucketCounts:
    """Counts per bound (the last slot +Inf) and their sum: a histogram's state, observed from one thread."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds) -> None:
        self.bounds = [float(b) for b in bounds]
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def frozen(self) -> tuple[tuple[int, ...], float]:
        """A copy another thread may read while this one goes on observing."""
        return tuple(self.counts), self.sum


class Histogram(BucketCounts):
    """A histogram observed from the event loop only, so without prometheus_client's per-observation locks.

    prometheus_client's Histogram takes a mutex for the bucket and again for the sum on every observe; with
    several latencies per request that adds up at thousands of requests per second. Exposed through a custom
    collector with the standard histogram layout (cumulative `_bucket{le}`, `_sum`, `_count`).
    """

    __slots__ = ("name", "documentation")

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry) -> None:
        super().__init__(buckets)
        self.name, self.documentation = name, documentation
        registry.register(self)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], cumulative_buckets(self.bounds, self.counts), self.sum)
        return [family]

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]


class _LoopValue:
    """A counter child's value that only the event loop increments. The child's own (prometheus_client's
    MutexValue) takes a lock on every increment, and Counter.inc checks its labels and the amount first: 0.55 us
    a count against 0.18 us here, paid for every final. Read by the metrics thread as a plain attribute."""

    __slots__ = ("_value", "_exemplar")

    def __init__(self, value: float = 0.0) -> None:
        self._value, self._exemplar = value, None

    def inc(self, amount: float = 1) -> None:
        self._value += amount

    def set(self, value: float, timestamp=None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar) -> None:
        self._exemplar = exemplar

    def get_exemplar(self):
        return self._exemplar


class CommitProgress:
    """Per request partition, whether its committed offset keeps up with what is read: read from the offset
    tracker at each scrape (nothing on the request path). `source`: () -> [(partition, committed offset, consumed
    offset, seconds stalled)] (OffsetTracker.commit_progress)."""

    def __init__(self, registry: CollectorRegistry, source: Callable[[], list] = lambda: []) -> None:
        self.source = source
        registry.register(self)

    def collect(self):
        stalled = GaugeMetricFamily(
            f"{NS}commit_stalled_seconds", "Seconds that records read from the partition have waited past its "
            "committed offset without that offset moving; 0 while everything read is committed. Grows without "
            "bound when commits stop (an answer never acknowledged, a request stuck, the broker refusing).",
            labels=["topic", "partition"])
        uncommitted = GaugeMetricFamily(
            f"{NS}uncommitted_offsets", "Offsets read from the partition past its committed offset: what a restart "
            "would read again.", labels=["topic", "partition"])
        try:
            rows = self.source()
        except Exception:  # noqa: BLE001 - read on the scrape thread while the loop changes the table: next time
            rows = []
        for partition, committed, consumed, stalled_s in rows:
            labels = [getattr(partition, "topic", ""), str(getattr(partition, "partition", partition))]
            stalled.add_metric(labels, round(stalled_s, 3))
            uncommitted.add_metric(labels, max(0, consumed - committed))
        return [stalled, uncommitted]

    def describe(self):
        return []


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up the worker's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # the base class's signature
        """Probes and scrapes every few seconds would flood the log."""


@dataclass(slots=True)
class WorkerMetrics:
    registry: CollectorRegistry
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    num_requests_waiting: Gauge
    num_requests_running: Gauge
    kv_cache_usage: Gauge
    prefix_cache_hit_rate: Gauge
    num_preemptions: Gauge
    """A gauge mirroring the engine's own running count (the engine owns the counter)."""
    adapter_loads: Gauge
    """Likewise for the engine's LoRA adapter loads."""
    draft_tokens: Gauge
    """Likewise for the engine's speculative draft tokens verified, and those kept."""
    accepted_draft_tokens: Gauge
    batch_size: Histogram
    consumer_lag: Gauge
    paused_partitions: Gauge
    requests_rejected: Counter
    requests_shed: Counter
    requests_completed: Counter
    dead_letters: Counter
    dropped_records: Counter
    unreadable_records: Counter
    requests_cancelled: Counter
    requests_resumed: Counter
    lifecycle_violations: Counter
    """Answers refused because their request had ended (a second final, or one after it was given up) and
    moves between stages that should not happen: 0 unless the worker has a bug (transport/requests/stages.py)."""
    resumed_tokens: Counter
    reply_topic_available: Gauge
    desired_workers: Gauge
    kafka_access_denied: Gauge
    """1 while the broker refuses this worker an operation it needs (an ACL withdrawn): fetching has stopped."""
    commits: CommitProgress
    _children: dict = field(default_factory=dict)

    @classmethod
    def create(cls, commit_progress: Callable[[], list] = lambda: []) -> "WorkerMetrics":
        r = CollectorRegistry()
        return cls(
            registry=r,
            time_to_first_token=Histogram(f"{NS}time_to_first_token_seconds", "Record timestamp to first token.",
                                          buckets=LATENCY_BUCKETS, registry=r),
            inter_token_latency=Histogram(f"{NS}inter_token_latency_seconds", "Mean gap between output tokens.",
                                          buckets=LATENCY_BUCKETS, registry=r),
            e2e_request_latency=Histogram(f"{NS}e2e_request_latency_seconds", "Record timestamp to final record.",
                                          buckets=LATENCY_BUCKETS, registry=r),
            request_queue_time=Histogram(f"{NS}request_queue_time_seconds", "Record timestamp to first scheduled.",
                                         buckets=LATENCY_BUCKETS, registry=r),
            num_requests_waiting=Gauge(f"{NS}num_requests_waiting", "Local queue plus engine waiting.", registry=r),
            num_requests_running=Gauge(f"{NS}num_requests_running", "Requests in the running batch.", registry=r),
            kv_cache_usage=Gauge(f"{NS}kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", registry=r),
            prefix_cache_hit_rate=Gauge(f"{NS}prefix_cache_hit_rate", "Prefix-cache hit rate (0..1).", registry=r),
            num_preemptions=Gauge(f"{NS}num_preemptions", "Preemptions since the engine started.", registry=r),
            adapter_loads=Gauge(f"{NS}adapter_loads", "LoRA adapter loads since the engine started (reloads after "
                                "an eviction included).", registry=r),
            draft_tokens=Gauge(f"{NS}spec_decode_draft_tokens", "Speculative draft tokens verified since the engine "
                               "started.", registry=r),
            accepted_draft_tokens=Gauge(f"{NS}spec_decode_accepted_tokens", "Speculative draft tokens kept since "
                                        "the engine started.", registry=r),
            batch_size=Histogram(f"{NS}batch_size", "Sequences per engine step.", buckets=BATCH_BUCKETS, registry=r),
            consumer_lag=Gauge(f"{NS}consumer_lag", "Unread plus locally queued requests.", ["priority"], registry=r),
            paused_partitions=Gauge(f"{NS}paused_partitions", "Paused request partitions.", ["priority"], registry=r),
            requests_rejected=Counter(f"{NS}requests_rejected", "Rejected or error finals.", ["reason"], registry=r),
            requests_shed=Counter(f"{NS}requests_shed", "Requests shed under load.", ["priority"], registry=r),
            requests_completed=Counter(f"{NS}requests_completed", "Completed finals.", ["priority"], registry=r),
            dead_letters=Counter(f"{NS}dead_letters", "Records moved to the dead-letter topic.", registry=r),
            dropped_records=Counter(f"{NS}dropped_records", "Records not delivered where addressed (topic missing "
                                    "or denied, or over its record limit); finals among them answered elsewhere.",
                                    ["topic"], registry=r),
            unreadable_records=Counter(f"{NS}unreadable_records", "Request offsets skipped: the batch holding "
                                       "them could not be read (e.g. a compression codec missing).", registry=r),
            requests_cancelled=Counter(f"{NS}requests_cancelled", "Cancelled finals (cancelled by their producer).",
                                       registry=r),
            lifecycle_violations=Counter(f"{NS}request_lifecycle_violations", "Answers refused because their "
                                         "request had ended, and other moves against a request's stages: 0 "
                                         "unless the worker has a bug.", registry=r),
            requests_resumed=Counter(f"{NS}requests_resumed", "Requests taken over from another worker whose "
                                     "streams went on where they stopped (docs/delivery.md, Resumed streams).",
                                     registry=r),
            resumed_tokens=Counter(f"{NS}resumed_tokens", "Output tokens resumed requests did not generate again.",
                                   registry=r),
            reply_topic_available=Gauge(f"{NS}reply_topic_available", "1 while an allowed reply topic exists and "
                                        "takes writes, 0 while it is missing or denied.", ["topic"], registry=r),
            desired_workers=Gauge(f"{NS}desired_workers", "Workers the group needs for the offered load and the "
                                  "backlog within the queue-time budgets, as this worker estimates it (average "
                                  "it over the workers to scale on); 0 while no estimate exists.", registry=r),
            kafka_access_denied=Gauge(f"{NS}kafka_access_denied", "1 while the broker refuses the worker an "
                                      "operation it needs (READ of the request topic or the group): nothing is "
                                      "fetched until it is allowed again.", registry=r),
            commits=CommitProgress(r, commit_progress),
        )

    def dropped_for(self, topic: str):
        return self._child(self.dropped_records, "topic", topic)

    def completed_for(self, priority: int):
        return self._child(self.requests_completed, "priority", priority)

    def rejected_for(self, reason: str):
        return self._child(self.requests_rejected, "reason", reason)

    def shed_for(self, priority: int):
        return self._child(self.requests_shed, "priority", priority)

    def _child(self, metric, label: str, value) -> "_LoopValue":
        """The value of the counter's child for this label value, to `inc()`: created once, then one dict lookup
        (on the raw value, so no str() per call) and one attribute update per count."""
        key = (metric._name, value)
        child = self._children.get(key)
        if child is None:
            labelled = metric.labels(**{label: str(value)})
            if not isinstance(labelled._value, _LoopValue):
                labelled._value = _LoopValue(labelled._value.get())
            child = self._children[key] = labelled._value
        return child

    def serve(self, port: int, addr: str = "0.0.0.0", ready: Callable[[], bool] | None = None):
        """Start the HTTP endpoint on a daemon thread; returns the server so it can be shut down. Besides the
        metrics (any path, as prometheus_client serves them), `/ready` answers 200 while `ready()` holds and
        503 otherwise: a readiness probe (deploy/worker.yaml)."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == "/ready":
                ok = ready is not None and ready()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"ready\n" if ok else b"not ready\n"]
            # prometheus_client answers an OpenMetrics Accept header (Prometheus sends one) with the ':' of our
            # names escaped to '_', so Prometheus would store names other than the ones documented and queried
            # (deploy/alerts.yaml): the classic text format keeps them as they are.
            return metrics_app(dict(environ, HTTP_ACCEPT="text/plain; version=0.0.4"), start_response)

        server = make_server(addr, port, app, _ThreadingServer, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
