"""What the transport knows of its tenants: the fair-share counters, the quotas and the per-tenant traffic, kept
where requests are read (intake), enter the engine (dispatcher) and end (streamer).

- intake: `check_quota` answers a request over its tenant's quota (reject mode) or lets it wait (defer);
  `note_read` marks the tenant as seen at its priority (contention, see tenants.FairShare.contended).
- dispatcher: `dispatched` gives the request its fair tag and charges its expected tokens.
- streamer: `waited` counts where a request's time went before its first step (WAIT_STAGES); `served` corrects
  the charge to the tokens really served, and counts them per tenant label.
- control loop: `snapshot` for the status topic and the metrics (a frozen list, read by other threads).

Pure: no aiokafka, no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from worker.transport.load.admission import Verdict
from worker.transport.metrics import LATENCY_BUCKETS, BucketCounts
from worker.transport.load.tenants import (DEFAULT_TENANT, NO_TENANT_LABEL, OTHER_LABEL, FairShare, Quota, Quotas,
                                           TenantLabels)


RATE_WINDOW_S = 1.0
"""Tokens per second in a snapshot are measured over at least this long."""

WAIT_STAGES = ("kafka", "local_queue", "engine")
"""Where a request waits before its first step: unread in Kafka (record timestamp to read), in the local queue
(read to handed to the engine), in the engine's waiting queue (handed over to first scheduled)."""
WAIT_BUCKETS_S = LATENCY_BUCKETS


@dataclass(slots=True, frozen=True)
class TenantSnapshot:
    """One tenant label's figures at one moment (the rest of the tenants summed under "other")."""

    label: str
    prompt_tokens: float
    """Served since the worker started (cumulative)."""
    output_tokens: float
    tokens_per_s: float
    """Tokens served per second since the previous snapshot."""
    num_waiting: int
    """In the local queue now."""
    num_finals: dict[str, int]
    """Final records by status since the worker started."""
    num_over_quota: int
    over_quota: bool
    """Its bucket is empty now: new requests are rejected (or deferred) until it refills."""
    served_by_priority: tuple[float, ...] = ()
    """Tokens (prompt and output) served per priority since the worker started: other workers charge what this
    one served to the tenant's fair-share counters (fleet_share.py)."""
    waits: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    """Per WAIT_STAGES stage with waits: (stage, counts per WAIT_BUCKETS_S bound and +Inf, sum of seconds), since
    the worker started."""
    in_flight_by_priority: tuple[float, ...] = ()
    """Tokens charged on entry to the tenant's requests in the engine now, per priority (from the streamer's open
    streams): with the served figures, other workers see the counter this worker keeps, not one that lags by a
    request's duration."""


def cache_salt_of(tenant: str, cache_salt: str | None) -> str | None:
    """The engine's prefix-cache namespace of a request: its tenant and its salt, unambiguously joined; None (the
    shared namespace) for a request with neither."""
    if tenant == DEFAULT_TENANT and cache_salt is None:
        return None
    return json.dumps([tenant, cache_salt])


@dataclass(slots=True)
class _Traffic:
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    num_finals: dict[str, int] = field(default_factory=dict)
    num_over_quota: int = 0
    by_priority: dict[int, float] = field(default_factory=dict)
    waits: dict[str, BucketCounts] = field(default_factory=dict)


@dataclass(slots=True)
class TenantBook:
    fair: FairShare
    quotas: Quotas = field(default_factory=Quotas)
    labels: TenantLabels = field(default_factory=TenantLabels)
    _traffic: dict[str, _Traffic] = field(default_factory=dict)
    """By label: cumulative, so a label's counters only grow (a tenant moved to "other" adds there from then)."""
    _last_totals: dict[str, float] = field(default_factory=dict)
    _last_at: float | None = None
    _rates: dict[str, float] = field(default_factory=dict)
    snapshot_now: tuple[TenantSnapshot, ...] = ()
    """The latest snapshot (replaced whole, so another thread reads a consistent one)."""

    @classmethod
    def from_settings(cls, settings, num_priorities: int) -> "TenantBook":
        """From WorkerSettings' tenant_* fields."""
        quotas = {name: Quota(q.rate_tokens_per_s, q.burst_tokens) for name, q in settings.tenant_quotas.items()}
        default = quotas.pop("*", None)
        return cls(
            FairShare(num_priorities, dict(settings.tenant_weights), settings.max_credit_tokens,
                      settings.tenant_contention_window_s),
            Quotas(quotas, default, settings.tenant_quota_action),
            TenantLabels(settings.tenant_max_labels),
        )

    # -- intake ----------------------------------------------------------------------------------------------
    def note_read(self, priority: int, tenant: str, tokens: float, now: float) -> None:
        """A request of `tenant` was read: it counts for contention and, by its expected tokens, for which tenants
        are the top ones by traffic (their own labels)."""
        self.fair.seen(priority, tenant, tokens, now)
        for label in self.labels.observe(tenant, tokens, now):
            self._last_totals.pop(label, None)

    def check_quota(self, tenant: str, tokens: float, now: float) -> Verdict | None:
        """Reject mode: take the request's expected tokens from its tenant's bucket, or answer it rejected /
        quota_exceeded with when the bucket will hold them. Defer mode: None (the dispatcher waits for them)."""
        wait = self.quotas.wait_s(tenant, tokens, now)
        if wait > 0:
            self.quotas.note_over(tenant)
            self._traffic_of(tenant).num_over_quota += 1
            if self.quotas.action == "reject":
                retry = "never (its rate is 0)" if math.isinf(wait) else f"in {wait:.1f} s"
                return Verdict("rejected", "quota_exceeded",
                               f"tenant {tenant!r} is over its token quota; it holds this request's tokens {retry}",
                               None if math.isinf(wait) else wait)
            return None
        if self.quotas.action == "reject":
            self.quotas.take(tenant, tokens, now)
        return None

    def dropped(self, tenant: str, tokens: float, now: float) -> None:
        """A queued request is answered without being served (shed): reject mode gives its tokens back."""
        if self.quotas.action == "reject":
            self.quotas.take(tenant, -tokens, now)

    # -- dispatch --------------------------------------------------------------------------------------------
    def may_dispatch(self, tenant: str, tokens: float, now: float) -> bool:
        """Defer mode: whether the tenant's bucket holds the request's tokens now."""
        return self.quotas.action != "defer" or self.quotas.wait_s(tenant, tokens, now) <= 0

    def dispatched(self, priority: int, tenant: str, tokens: float, now: float) -> float:
        """The request enters the engine: returns its fair tag; charges its tokens to the counter (and, deferring,
        to the bucket)."""
        tag = self.fair.start_tag(priority, tenant)
        self.fair.charge(priority, tenant, tokens)
        self.fair.add_pending(priority, tenant, tokens)
        if self.quotas.action == "defer":
            self.quotas.take(tenant, tokens, now)
        return tag

    def started(self, priority: int, tenant: str, charged: float) -> None:
        """A completion charged `charged` on entry got its first token (or ended before one)."""
        self.fair.started(priority, tenant, charged)

    # -- the end ---------------------------------------------------------------------------------------------
    def served(self, priority: int, tenant: str, prompt_tokens: int, output_tokens: int, charged: float,
               now: float) -> None:
        """A completion ended having been served these tokens, of which `charged` were charged on entry: the
        counter and the bucket take the difference."""
        actual = prompt_tokens + output_tokens
        self.fair.charge(priority, tenant, actual - charged)
        self.quotas.take(tenant, actual - charged, now)
        traffic = self._traffic_of(tenant)
        traffic.prompt_tokens += prompt_tokens
        traffic.output_tokens += output_tokens
        traffic.by_priority[priority] = traffic.by_priority.get(priority, 0.0) + actual

    def waited(self, tenant: str, stages_s: tuple[float, float, float]) -> None:
        """A request reached its first step after waiting these seconds in each of WAIT_STAGES."""
        waits = self._traffic_of(tenant).waits
        for stage, seconds in zip(WAIT_STAGES, stages_s):
            histogram = waits.get(stage)
            if histogram is None:
                histogram = waits[stage] = BucketCounts(WAIT_BUCKETS_S)
            histogram.observe(seconds)

    def finished(self, tenant: str, status: str) -> None:
        finals = self._traffic_of(tenant).num_finals
        finals[status] = finals.get(status, 0) + 1

    # -- reporting -------------------------------------------------------------------------------------------
    def snapshot(self, now: float, waiting_by_tenant: dict[str, int],
                 charged_in_engine: dict[tuple[str, int], float] | None = None) -> tuple[TenantSnapshot, ...]:
        """Per label, most traffic first; also kept as `snapshot_now`. Labels given up since the last call are
        left out (their series end). `charged_in_engine`: (tenant, priority) -> tokens charged on entry to the
        requests in the engine now (Streamer.charged_in_engine), reported as each label's in-flight figures."""
        live = {self.labels.label(t) for t in self.labels.labelled} | {NO_TENANT_LABEL, OTHER_LABEL}
        waiting: dict[str, int] = {}
        for tenant, num in waiting_by_tenant.items():
            label = self.labels.label(tenant)
            waiting[label] = waiting.get(label, 0) + num
            live.add(label)
            self._traffic.setdefault(label, _Traffic())
        in_flight: dict[str, dict[int, float]] = {}
        for (tenant, priority), tokens in (charged_in_engine or {}).items():
            by_priority = in_flight.setdefault(self.labels.label(tenant), {})
            by_priority[priority] = by_priority.get(priority, 0.0) + tokens
        for label in in_flight:
            live.add(label)
            self._traffic.setdefault(label, _Traffic())
        # Rates over at least RATE_WINDOW_S: the control loop asks many times a second.
        dt = None if self._last_at is None else now - self._last_at
        fresh = dt is None or dt >= RATE_WINDOW_S
        snaps = []
        for label, traffic in self._traffic.items():
            if label not in live:
                continue
            total = traffic.prompt_tokens + traffic.output_tokens
            if fresh:
                rate = 0.0 if dt is None else max(0.0, total - self._last_totals.get(label, total)) / dt
                self._last_totals[label] = total
                self._rates[label] = rate
            rate = self._rates.get(label, 0.0)
            tenant = DEFAULT_TENANT if label == NO_TENANT_LABEL else label
            over = label in self.labels.labelled and self.quotas.over_quota(tenant, now)
            snaps.append(TenantSnapshot(label, traffic.prompt_tokens, traffic.output_tokens, rate,
                                        waiting.get(label, 0), dict(traffic.num_finals), traffic.num_over_quota,
                                        over, _by_priority(traffic.by_priority),
                                        tuple((stage, *h.frozen()) for stage, h in traffic.waits.items()),
                                        _by_priority(in_flight.get(label, {}))))
        self._traffic = {label: t for label, t in self._traffic.items() if label in live}
        if fresh:
            self._last_at = now
        self.snapshot_now = tuple(sorted(snaps, key=lambda s: -(s.prompt_tokens + s.output_tokens)))
        return self.snapshot_now

    def _traffic_of(self, tenant: str) -> _Traffic:
        label = self.labels.label(tenant)
        traffic = self._traffic.get(label)
        if traffic is None:
            traffic = self._traffic[label] = _Traffic()
        return traffic


def _by_priority(tokens: dict[int, float]) -> tuple[float, ...]:
    """Index = priority, up to the highest with tokens."""
    return tuple(tokens.get(p, 0.0) for p in range(max(tokens, default=-1) + 1))
