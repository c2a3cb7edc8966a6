"""Hostile variety never grows the worker past its documented bounds (docs/memory.md): a flood of distinct
reply topics under an allowed prefix, distinct request ids (the publisher's key memory), distinct cancelled
ids. Pure parts, no broker: each table is driven past its bound and must stay at it."""

from __future__ import annotations

import time
from pathlib import Path

from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine
from worker.transport.kafka import publisher as publisher_module
from worker.transport.load.admission import Admission
from worker.transport.requests.cancels import CancelledIds
from worker.transport.kafka.destinations import MAX_TOPICS, Destinations, TopicState
from worker.transport.kafka.publisher import Publisher
from worker.transport.worker import Worker
from tests.transport.kafka_helpers import worker_settings


class NoProbe:
    async def close(self) -> None:
        pass


def test_destinations_keep_at_most_max_topics_the_latest_ones():
    destinations = Destinations(NoProbe())
    for i in range(3 * MAX_TOPICS):
        destinations.mark_unavailable(f"llm.replies.hostile-{i}", "missing")
    assert len(destinations._states) == MAX_TOPICS
    latest = f"llm.replies.hostile-{3 * MAX_TOPICS - 1}"
    assert destinations.state(latest) is not None
    assert destinations.state("llm.replies.hostile-0") is None  # forgotten: looked up again if named again


async def test_prefixed_reply_topics_bound_admission_and_make_no_metric_series_each():
    kafka = KafkaSettings(allowed_reply_topics=["listed"], allowed_reply_topic_prefixes=["llm.replies."])
    worker = Worker(kafka, worker_settings(), InstantEngine())
    worker.admission = Admission(kafka.result_topic, frozenset(kafka.allowed_reply_topics), [0.0],
                                 allowed_reply_topic_prefixes=("llm.replies.",))
    for i in range(2 * MAX_TOPICS):
        worker._on_topic_change(f"llm.replies.hostile-{i}", TopicState(False, 0.0, "missing"))
        worker.metrics.dropped_for(worker._topic_label(f"llm.replies.hostile-{i}")).inc()
    worker._on_topic_change("listed", TopicState(False, 0.0, "missing"))
    unavailable = worker.admission.unavailable_reply_topics
    assert len(unavailable) == MAX_TOPICS and "listed" in unavailable
    # The newest prefixed topics are still answered at once; the oldest are looked up again when named.
    assert worker.admission.check_reply_topic(f"llm.replies.hostile-{2 * MAX_TOPICS - 1}") is not None
    exposition = worker.metrics.exposition()
    assert exposition.count("reply_topic_available{") == 1  # the listed topic only
    assert 'dropped_records_total{topic="reply_topic_by_prefix"} 2048.0' in exposition
    assert len(worker.metrics._children) == 1
    await worker.close()


async def test_the_publishers_key_memory_stays_under_its_bound(monkeypatch):
    monkeypatch.setattr(publisher_module, "KEY_PARTITIONS_MAX", 100)
    publisher = Publisher({"bootstrap_servers": "127.0.0.1:1"})
    publisher._partitions["results"] = (time.monotonic(), [0, 1, 2])  # known: no metadata request
    seen = {}
    for i in range(1000):
        key = f"request-{i}".encode()
        seen[key] = await publisher.partition_of("results", key)
        assert publisher.num_cached_keys <= 100
    # The bound only forgets: a key hashes to the same partition whether remembered or not.
    assert all([await publisher.partition_of("results", key) == p for key, p in seen.items()])


def test_a_flood_of_distinct_cancels_keeps_max_ids():
    cancels = CancelledIds(ttl_s=900.0, max_ids=1000)
    for i in range(50_000):
        cancels.add(f"unknown-{i}", 1_000.0 + i, 1_000.0 + i)
    assert len(cancels) == 1000 and cancels.num_evicted == 49_000


def test_every_bound_here_is_in_the_memory_doc():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    for name in ("MAX_TOPICS", "KEY_PARTITIONS_MAX", "WORKER_CANCEL_MAX_IDS", "WORKER_MALLOC_ARENA_MAX"):
        assert name in doc, name
