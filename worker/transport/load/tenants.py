"""Tenants inside a priority: fair share by tokens served, quotas, and metric labels of bounded cardinality.

Fair share is the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng et al., OSDI
2024), per priority: each tenant has a counter of the tokens (prompt and output) it was served, divided by its
weight; the next request to enter the engine is the head of the backlogged tenant with the smallest counter.
Backlogged tenants therefore get equal service (weighted), whatever their arrival rates. A tenant that was
idle is lifted, when it becomes backlogged again, to at least the smallest counter of the others minus
`max_credit_tokens`: an idle tenant banks at most that much credit, so it cannot return and monopolise the
engine for a long time.

A request is charged its expected tokens when it enters the engine (so a tenant cannot fill the engine in one
go before its first tokens come back) and corrected to what it was really served when it ends. Until it starts
(its first token) that charge is pending: a tenant lifted as it becomes backlogged is lifted to the others'
counters without their pending charges. Counted in, a flood's requests waiting in the engine would lift a calm
tenant's request behind them there, and it would wait for each of them to get a seat.

Pure: no aiokafka, no torch; times are passed in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_TENANT = ""
"""The tenant of requests that name none: they share one counter, one quota and one cache namespace."""
READ_HALF_LIFE_S = 10.0
"""How fast a tenant's recent reads fade, for telling who is over its share (FairShare.over_share)."""
SHARE_MARGIN = 0.2
"""A tenant whose recent reads are within this fraction above the mean is at its share, not over it."""
OTHER_LABEL = "other"
"""The metric label of tenants outside the top ones by traffic."""
NO_TENANT_LABEL = "none"
"""The metric label of requests without a tenant."""


@dataclass(slots=True)
class FairShare:
    """Virtual token counters per priority, and which tenants were seen recently (contention)."""

    num_priorities: int
    weights: dict[str, float] = field(default_factory=dict)
    """Tenant -> weight (default 1): a backlogged tenant of weight 2 gets twice the tokens of one of weight 1."""
    max_credit_tokens: float = 2048.0
    contention_window_s: float = 30.0
    """Two or more tenants read at a priority within this window make it contended (see `contended`)."""
    max_tenants: int = 10_000
    """Counters kept per priority; beyond it the idle tenants with the smallest counters are forgotten (a
    forgotten tenant starts again at the lift, which is where it would stand anyway once it idled long)."""
    _counters: list[dict[str, float]] = field(default_factory=list)
    _virtual: list[float] = field(default_factory=list)
    """Per priority: the counter of the tenant picked last (the lift's base when no other tenant waits)."""
    _virtual_pending: list[float] = field(default_factory=list)
    """Per priority: the pending charges counted in _virtual when it was set."""
    _pending: list[dict[str, float]] = field(default_factory=list)
    """Per priority: tenant -> charges (per unit of weight) of its requests in the engine that have not started."""
    _seen: list[dict[str, list[float]]] = field(default_factory=list)
    """Per priority: tenant -> [tokens read per unit of weight (decayed), when last read]."""

    def __post_init__(self) -> None:
        assert all(w > 0 and math.isfinite(w) for w in self.weights.values()), self.weights
        self._counters = [{} for _ in range(self.num_priorities)]
        self._virtual = [0.0] * self.num_priorities
        self._virtual_pending = [0.0] * self.num_priorities
        self._pending = [{} for _ in range(self.num_priorities)]
        self._seen = [{} for _ in range(self.num_priorities)]

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, priority: int, tenant: str) -> float:
        return self._counters[priority].get(tenant, self._virtual[priority] - self.max_credit_tokens)

    def lift(self, priority: int, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` becomes backlogged (its first request waits) while `backlogged` (the others) wait."""
        counters, pending = self._counters[priority], self._pending[priority]
        virtual = self._virtual[priority]
        served_to = virtual - self._virtual_pending[priority]
        # Not below where service has reached (the tag last picked): a tenant still spending its own credit is
        # below it, and counting from it would hand each tenant that arrives after it the credit again, one
        # bound lower each time (four tenants arriving together: the last 6,144 tokens ahead of the first).
        base = max(min((counters.get(t, virtual) - pending.get(t, 0.0) for t in backlogged if t != tenant),
                       default=served_to), served_to)
        counters[tenant] = max(counters.get(tenant, -math.inf), base - self.max_credit_tokens)
        if len(counters) > self.max_tenants:
            self._forget(priority, set(backlogged) | {tenant})

    def pick(self, priority: int, tenants: Iterable[str]) -> str:
        """The tenant to serve next among the backlogged `tenants` (ties: the first given)."""
        counters = self._counters[priority]
        virtual = self._virtual[priority]
        return min(tenants, key=lambda t: counters.get(t, virtual))

    def start_tag(self, priority: int, tenant: str) -> float:
        """The tenant's counter as its request enters the engine, before it is charged: the engine orders its
        waiting requests of a priority by it (start-time fair queueing), so a request of a tenant below its
        share overtakes the queued requests of one above it there too."""
        tag = self.counter(priority, tenant)
        if tag >= self._virtual[priority]:
            self._virtual[priority] = tag
            self._virtual_pending[priority] = self._pending[priority].get(tenant, 0.0)
        return tag

    def add_pending(self, priority: int, tenant: str, tokens: float) -> None:
        """Charged tokens of a request that entered the engine and has not started yet."""
        pending = self._pending[priority]
        pending[tenant] = pending.get(tenant, 0.0) + tokens / self.weight(tenant)

    def started(self, priority: int, tenant: str, tokens: float) -> None:
        """A request with this charge started (or ended without starting): its charge is no longer pending."""
        pending = self._pending[priority]
        left = pending.get(tenant, 0.0) - tokens / self.weight(tenant)
        if left > 1e-9:
            pending[tenant] = left
        else:
            pending.pop(tenant, None)

    def charge(self, priority: int, tenant: str, tokens: float) -> None:
        """Add served tokens (negative: a correction) to the tenant's counter."""
        counters = self._counters[priority]
        counters[tenant] = counters.get(tenant, self._virtual[priority]) + tokens / self.weight(tenant)

    def seen(self, priority: int, tenant: str, tokens: float, now: float) -> None:
        """A request of `tenant` with `tokens` expected tokens was read at `priority`."""
        reads = self._seen[priority]
        entry = reads.get(tenant)
        if entry is None:
            entry = reads[tenant] = [0.0, now]
        entry[0] = self._decayed(entry, now) + tokens / self.weight(tenant)
        entry[1] = now
        if len(reads) > 64:  # the heavy and the recent matter: keep those
            cutoff = now - self.contention_window_s
            stale = [t for t, e in reads.items() if e[1] < cutoff]
            for old in stale or heapq.nsmallest(32, reads, key=lambda t: self._decayed(reads[t], now)):
                del reads[old]

    def contended(self, priority: int, now: float) -> bool:
        """Whether two or more tenants were read at this priority within the contention window. Then a full
        local queue keeps reading and sheds the tenant holding most of it, instead of pausing: the records of
        the others sit in Kafka behind the flood's, and pausing would hold them there with it."""
        cutoff = now - self.contention_window_s
        return sum(1 for e in self._seen[priority].values() if e[1] >= cutoff) >= 2

    def over_share(self, priority: int, tenant: str, now: float) -> bool:
        """Whether shedding may fall on the tenant: its recent reads at this priority (tokens per unit of weight,
        decayed with a half-life of READ_HALF_LIFE_S) are clearly above the mean of the tenants read recently
        (by SHARE_MARGIN), or no tenant's are, and then it falls on all of them alike (a lone tenant too). An
        exact comparison with the mean marked one of two tenants of equal rates at a time, and as the decayed
        rates drift apart by chance, the same one for seconds: every new request of one of them was shed and
        none of the other's."""
        reads = self._seen[priority]
        entry = reads.get(tenant)
        if entry is None:
            return False
        rates = [self._decayed(e, now) for e in reads.values()]
        bar = sum(rates) / len(rates) * (1 + SHARE_MARGIN)
        return self._decayed(entry, now) >= bar or max(rates) < bar

    @staticmethod
    def _decayed(entry: list[float], now: float) -> float:
        return entry[0] * 0.5 ** (max(0.0, now - entry[1]) / READ_HALF_LIFE_S)

    def num_tenants(self) -> int:
        return sum(len(c) for c in self._counters)

    def _forget(self, priority: int, keep: set[str]) -> None:
        counters = self._counters[priority]
        idle = [t for t in counters if t not in keep]
        for tenant in heapq.nsmallest(len(counters) - self.max_tenants // 2, idle, key=counters.get):
            del counters[tenant]


@dataclass(slots=True, frozen=True)
class Quota:
    rate_tokens_per_s: float
    """Sustained tokens (prompt and expected output) per second."""
    burst_tokens: float
    """Tokens it may take at once after being idle (the bucket's size)."""


@dataclass(slots=True)
class Quotas:
    """Per-tenant token buckets. A request takes its expected tokens from its tenant's bucket; it is corrected to
    what it was served when it ends. `action`: "reject" answers a request over quota at once (rejected /
    quota_exceeded, with when to retry: the default, so a producer hears it at once and nothing waits on it);
    "defer" keeps it in the local queue until the bucket holds its tokens (its deadline still applies)."""

    quotas: dict[str, Quota] = field(default_factory=dict)
    default: Quota | None = None
    """For tenants not named in `quotas` (requests without a tenant included); None: no quota."""
    action: str = "reject"
    max_tenants: int = 10_000
    _level: dict[str, float] = field(default_factory=dict)
    _at: dict[str, float] = field(default_factory=dict)
    num_over: dict[str, int] = field(default_factory=dict)
    """Requests found over quota, by tenant (rejected, or deferred at least once)."""

    def __post_init__(self) -> None:
        assert self.action in ("reject", "defer"), self.action

    def quota_of(self, tenant: str) -> Quota | None:
        return self.quotas.get(tenant, self.default)

    def level(self, tenant: str, now: float) -> float:
        quota = self.quota_of(tenant)
        if quota is None:
            return math.inf
        level = self._level.get(tenant, quota.burst_tokens)
        elapsed = max(0.0, now - self._at.get(tenant, now))
        return min(quota.burst_tokens, level + elapsed * quota.rate_tokens_per_s)

    def wait_s(self, tenant: str, tokens: float, now: float) -> float:
        """Seconds until the bucket holds `tokens` (at most its burst: a request larger than the burst waits for
        a full bucket); 0 when it holds them now, inf when the rate is 0."""
        quota = self.quota_of(tenant)
        if quota is None:
            return 0.0
        missing = min(tokens, quota.burst_tokens) - self.level(tenant, now)
        if missing <= 0:
            return 0.0
        return missing / quota.rate_tokens_per_s if quota.rate_tokens_per_s > 0 else math.inf

    def take(self, tenant: str, tokens: float, now: float) -> None:
        """Take tokens (negative: give back); the level may go below 0, which later requests wait out."""
        quota = self.quota_of(tenant)
        if quota is None:
            return
        self._level[tenant] = self.level(tenant, now) - tokens
        self._at[tenant] = now
        if len(self._level) > self.max_tenants:
            self._forget(now)

    def note_over(self, tenant: str) -> None:
        self.num_over[tenant] = self.num_over.get(tenant, 0) + 1
        if len(self.num_over) > self.max_tenants:
            for t in heapq.nsmallest(len(self.num_over) // 2, self.num_over, key=self.num_over.get):
                del self.num_over[t]

    def over_quota(self, tenant: str, now: float) -> bool:
        return self.level(tenant, now) < 0

    def _forget(self, now: float) -> None:
        """Drop full buckets: a tenant not in the table starts with a full one, the same state."""
        for tenant in [t for t in self._level if self.level(t, now) >= self.quota_of(t).burst_tokens]:
            del self._level[tenant], self._at[tenant]


@dataclass(slots=True)
class TenantLabels:
    """Metric and status labels for tenants, of bounded cardinality: the `max_labels` tenants with the most
    tokens (decayed) have their own label, the rest share "other". The set is chosen again every
    `refresh_s`; a tenant that drops out gives its label up (its series are removed by the caller)."""

    max_labels: int = 10
    refresh_s: float = 30.0
    half_life_s: float = 300.0
    max_tracked: int = 1_000
    _traffic: dict[str, float] = field(default_factory=dict)
    _labelled: set[str] = field(default_factory=set)
    _refreshed_at: float = -math.inf
    _decayed_at: float = 0.0

    def label(self, tenant: str) -> str:
        if tenant == DEFAULT_TENANT:
            return NO_TENANT_LABEL
        return tenant if tenant in self._labelled else OTHER_LABEL

    def observe(self, tenant: str, tokens: float, now: float) -> list[str]:
        """Count traffic; returns the labels given up when the set was chosen again (else [])."""
        if tenant == DEFAULT_TENANT:
            return []
        self._traffic[tenant] = self._traffic.get(tenant, 0.0) + tokens
        if len(self._traffic) > self.max_tracked:
            for t in heapq.nsmallest(len(self._traffic) - self.max_tracked // 2, self._traffic,
                                     key=self._traffic.get):
                if t not in self._labelled:
                    del self._traffic[t]
        if now - self._refreshed_at < self.refresh_s and (len(self._labelled) >= self.max_labels
                                                           or tenant in self._labelled):
            return []
        return self._refresh(now)

    def top(self, num: int | None = None) -> list[tuple[str, float]]:
        """Tenants by decayed traffic, most first."""
        ranked = sorted(self._traffic.items(), key=lambda item: -item[1])
        return ranked[:num] if num is not None else ranked

    def _refresh(self, now: float) -> list[str]:
        factor = 0.5 ** (max(0.0, now - self._decayed_at) / self.half_life_s)
        self._decayed_at = now
        for t in self._traffic:
            self._traffic[t] *= factor
        self._refreshed_at = now
        top = {t for t, _ in self.top(self.max_labels)}
        dropped = sorted(self._labelled - top)
        self._labelled = top
        return dropped

    @property
    def labelled(self) -> frozenset[str]:
        return frozenset(self._labelled)
