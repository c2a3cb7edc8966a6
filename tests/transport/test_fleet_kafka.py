"""Running as a fleet, through the real broker with one model-free worker shared by every case: the
autoscaling signal in its status records and metrics, and readiness on the metrics port."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
import uuid

import pytest

from schemas.request import GenerationRequest
from worker.broker.net import free_port
from worker.config import KafkaSettings
from worker.engine.instant import InstantEngine
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
async def fleet(kafka_bootstrap):
    from worker.broker.topics import ensure_topics

    suffix = uuid.uuid4().hex[:12]
    kafka = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, request_topic=f"test.requests.{suffix}",
        result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
        status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}", group_id=f"fleet-{suffix}",
    )
    await ensure_topics(kafka)
    port = free_port()
    # A step time, so the engine has a capacity to estimate from (a free engine has none).
    engine = InstantEngine(max_num_seqs=8, step_time_s=0.01)
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(metrics_port=port), engine) as worker:
            yield kafka, worker, collector, port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_a_backlog_shows_in_the_status_records_desired_workers(fleet):
    kafka, worker, collector, port = fleet
    requests = [(1 + i % 2, GenerationRequest(id=f"scale-{i}", prompt=f"backlog {i}", max_new_tokens=30))
                for i in range(120)]
    await produce_requests(kafka, requests)
    await collector.wait_until(lambda r: all(f"scale-{i}" in r.finals for i in range(120)), 60, "every final")
    estimates = [s.desired_workers for s in collector.results.statuses if s.desired_workers is not None]
    assert estimates and max(estimates) > 0.0, collector.results.summary()
    status, body = _get(port, "/metrics")
    assert status == 200 and "llm_worker:desired_workers" in body


async def test_ready_once_joined(fleet):
    _, worker, _, port = fleet
    assert worker.ready()
    assert _get(port, "/ready")[0] == 200
