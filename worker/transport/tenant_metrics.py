"""Per-tenant series on the metrics endpoint, of bounded cardinality (load/tenant_book.py: the top tenants by
traffic each, the rest "other", requests without a tenant "none"). Read at each scrape, on the metrics server's
thread, from the book's latest snapshot: a tuple replaced whole by the control loop, never a live table."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.transport.load.tenant_book import TenantBook
from worker.transport.metrics import NS


class TenantCollector:
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
        for t in snapshot:
            tokens.add_metric([t.label, "prompt"], t.prompt_tokens)
            tokens.add_metric([t.label, "output"], t.output_tokens)
            for status, num in sorted(t.num_finals.items()):
                finals.add_metric([t.label, status], num)
            waiting.add_metric([t.label], t.num_waiting)
            over.add_metric([t.label], float(t.over_quota))
        return [tokens, finals, waiting, over]

    def describe(self):
        return []
