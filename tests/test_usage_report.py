"""`llm-worker usage report`: --since parsing, per-tenant sums that count each request once, and the command
itself against the real broker, reading committed usage records and skipping an aborted transaction's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from schemas.decode import encode
from schemas.usage import UsageRecord
from worker.usage_report import parse_since, render_table, summarize

REPO = Path(__file__).resolve().parents[1]


def usage(request_id: str, attempt: int = 1, tenant: str = "acme", priority: int = 1, status: str = "completed",
          prompt: int = 10, output: int = 5, cached: int = 0) -> UsageRecord:
    return UsageRecord(id=request_id, attempt=attempt, tenant=tenant, priority=priority, status=status,
                       reason="length", prompt_tokens=prompt, completion_tokens=output, cached_tokens=cached)


def test_since_takes_durations_and_iso_dates():
    now = 1_800_000_000.0
    assert parse_since("90s", now) == (now - 90) * 1000
    assert parse_since("24h", now) == (now - 86400) * 1000
    assert parse_since("7d", now) == (now - 7 * 86400) * 1000
    assert parse_since("2026-12-01") == 1796083200000
    assert parse_since("2026-12-01T01:00:00+01:00") == 1796083200000
    with pytest.raises(ValueError, match="duration such as 24h"):
        parse_since("yesterday")


def test_rows_count_each_request_once_at_its_highest_attempt():
    rows = summarize([
        usage("a", attempt=1, output=3), usage("a", attempt=2, output=5),  # served again: the later one counts
        usage("b", cached=4), usage("c", tenant="", priority=0, status="rejected", prompt=0, output=0),
        usage("d", tenant="zeta", priority=2),
    ])
    assert [(r.tenant, r.priority, r.requests, r.completion_tokens) for r in rows] == [
        ("", 0, 1, 0), ("acme", 1, 2, 10), ("zeta", 2, 1, 5)]
    assert rows[1].cached_tokens == 4 and rows[0].by_status == {"rejected": 1}
    table = render_table(rows)
    assert table.splitlines()[0].split() == ["tenant", "priority", "requests", "completed", "other", "prompt",
                                             "cached", "output"]
    assert table.splitlines()[-1].split() == ["total", "4", "3", "1", "30", "4", "15"]
    assert "(none)" in table


@pytest.mark.kafka
async def test_the_report_reads_committed_usage_only(kafka_topics):
    kafka = kafka_topics
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, transactional_id=f"{kafka.group_id}-t")
    await producer.start()
    try:
        async with producer.transaction():
            for i in range(3):
                record = usage(f"r{i}", tenant="acme" if i else "beta", priority=i % 3, prompt=10 + i, output=2)
                await producer.send_and_wait(kafka.usage_topic, encode(record), key=record.id.encode())
        await producer.begin_transaction()
        await producer.send_and_wait(kafka.usage_topic, encode(usage("aborted", output=1000)), key=b"aborted")
        await producer.abort_transaction()
    finally:
        await producer.stop()
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "KAFKA_USAGE_TOPIC": kafka.usage_topic}
    done = subprocess.run([str(REPO / ".venv" / "bin" / "llm-worker"), "usage", "report", "--since", "1h", "--json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["totals"] == {"requests": 3, "prompt_tokens": 33, "cached_tokens": 0, "completion_tokens": 6}
    assert [(r["tenant"], r["priority"], r["requests"]) for r in report["rows"]] == [
        ("acme", 1, 1), ("acme", 2, 1), ("beta", 0, 1)]
    table = subprocess.run([str(REPO / ".venv" / "bin" / "llm-worker"), "usage", "report", "--since",
                            time.strftime("%Y-%m-%d", time.gmtime(time.time() - 86400))],
                           env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and table.stdout.splitlines()[-1].split()[:2] == ["total", "3"], table.stdout
