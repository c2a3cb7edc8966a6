"""The worker's memory on its metrics endpoint: the process's resident size, the Python heap, glibc's heap,
and the entries of every table that holds something per request (docs/memory.md). Read at each scrape, on
the metrics server's thread: lengths of dicts and counters only, so a scrape costs microseconds and never
walks the heap (sys.getallocatedblocks is a counter; mallinfo2 walks glibc's free lists, not the objects).

A soak run (benchmarks/bench_soak.py) samples these to tell a leak (a table that keeps growing, or Python's
blocks) from the allocator (native in-use flat while free or resident grows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from worker.memory import native_heap, python_allocated_blocks, resident_bytes, resident_parts
from worker.transport.metrics import NS

log = logging.getLogger(__name__)


class MemoryCollector:
    """A prometheus_client collector. `tables`: name -> a callable giving its number of entries now; one that
    raises (a part not built yet, or rebuilt on a reconnect) is left out of that scrape."""

    def __init__(self, registry: CollectorRegistry, tables: dict[str, Callable[[], int]]) -> None:
        self.tables = tables
        registry.register(self)

    def table_sizes(self) -> dict[str, int]:
        sizes = {}
        for name, size in self.tables.items():
            try:
                sizes[name] = int(size())
            except Exception:  # noqa: BLE001 - a scrape must not fail for one table
                continue
        return sizes

    def collect(self):
        rss = resident_bytes()
        if rss is not None:
            yield GaugeMetricFamily(f"{NS}resident_memory_bytes", "Resident set size of the worker process.",
                                    value=rss)
        parts = resident_parts()
        if parts is not None and "anon" in parts:
            yield GaugeMetricFamily(f"{NS}resident_anonymous_bytes", "The part of the resident size that maps no "
                                    "file: heaps and anonymous mappings (what a leak grows; the rest is mostly "
                                    "the libraries' pages).", value=parts["anon"])
        yield GaugeMetricFamily(f"{NS}python_allocated_blocks", "Memory blocks Python's allocator has handed out "
                                "(sys.getallocatedblocks).", value=python_allocated_blocks())
        heap = native_heap()
        if heap is not None:
            yield GaugeMetricFamily(f"{NS}native_heap_in_use_bytes", "glibc malloc: allocated and not freed.",
                                    value=heap.in_use_bytes)
            yield GaugeMetricFamily(f"{NS}native_heap_free_bytes", "glibc malloc: freed, kept in its arenas.",
                                    value=heap.free_bytes)
        family = GaugeMetricFamily(f"{NS}table_entries", "Entries of each per-request table and cache.",
                                   labels=["table"])
        for name, size in self.table_sizes().items():
            family.add_metric([name], size)
        yield family

    def describe(self):
        return []
