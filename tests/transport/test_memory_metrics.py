"""The memory gauges on the worker's metrics endpoint, read back the way the soak benchmark reads them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.bench_soak import parse_metrics
from worker.transport.memory_metrics import MemoryCollector


def test_tables_and_heap_gauges_are_exposed_and_a_failing_table_is_left_out():
    registry = CollectorRegistry()
    streams: dict = {"a": 1, "b": 2}

    def not_built_yet() -> int:
        raise AttributeError("queue")

    MemoryCollector(registry, {"streams": lambda: len(streams), "local_queue": not_built_yet})
    parsed = parse_metrics(generate_latest(registry).decode())
    assert parsed["tables"] == {"streams": 2.0}
    assert parsed["resident_memory_bytes"] > 0
    assert parsed["python_allocated_blocks"] > 0
    streams.clear()
    assert parse_metrics(generate_latest(registry).decode())["tables"] == {"streams": 0.0}


async def test_a_worker_exposes_every_per_request_table():
    from tests.transport.kafka_helpers import worker_settings
    from worker.kafka_settings import KafkaSettings
    from worker.engine.instant import InstantEngine
    from worker.transport.worker import Worker

    worker = Worker(KafkaSettings(), worker_settings(), InstantEngine())
    names = set(worker._tables())
    assert {"streams", "local_queue", "engine_in_flight", "offsets_pending", "cancelled_ids", "publisher_keys",
            "metric_children"} <= names
    # Built whole before it connects: every table is there, empty.
    assert worker.memory.table_sizes() == dict.fromkeys(names, 0)
    await worker.close()
