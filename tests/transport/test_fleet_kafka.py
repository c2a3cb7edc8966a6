"""Running as a fleet, through the real broker with one model-free worker shared by every case: the
autoscaling signal in its status records and metrics, readiness on the metrics port, traces through Kafka
headers (a librdkafka producer's traceparent continues into the worker's spans and its results), and a real
Prometheus (Debian's package) scraping the worker with deploy/alerts.yaml loaded."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from schemas.request import GenerationRequest
from worker.broker.net import free_port
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.decode import encode
from schemas.priority import partition_for
from worker.transport.requests.tracing import RequestTracing
from worker.transport.worker import Worker
from tests.transport.kafka_helpers import Collector, WaitTimeout, produce_requests, worker_settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ARRIVAL_WINDOW_S = 6.0


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
    spans = InMemorySpanExporter()
    provider = TracerProvider()  # this worker's own, not the process-wide one
    provider.add_span_processor(SimpleSpanProcessor(spans))
    async with Collector(kafka) as collector:
        # The worker's capacity model is told the engine's seats (it is built with them in production).
        # A shorter arrival window than the shipped 20 s, so the idle estimate after a burst comes sooner.
        worker = Worker(kafka, worker_settings(metrics_port=port, scale_arrival_window_s=ARRIVAL_WINDOW_S), engine,
                        max_num_seqs=engine.max_num_seqs,
                        tracing=RequestTracing(provider.get_tracer("test"), model="instant"))
        task = asyncio.create_task(worker.run())
        try:
            async with asyncio.timeout(30):
                await worker.started.wait()
            yield kafka, worker, collector, port, spans
        finally:
            worker.stop()
            assert await asyncio.wait_for(task, 60) == 0


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_a_backlog_shows_in_the_status_records_desired_workers(fleet):
    kafka, worker, collector, port, _ = fleet
    requests = [(1 + i % 2, GenerationRequest(id=f"scale-{i}", prompt=f"backlog {i}", max_new_tokens=30))
                for i in range(120)]
    await produce_requests(kafka, requests)
    await collector.wait_until(lambda r: all(f"scale-{i}" in r.finals for i in range(120)), 60, "every final")
    # On the shipped budgets ([10, 30, 0]: priority 2 unbounded), a burst of 3,600 output tokens that one worker
    # of 8 seats at 10 ms a step serves in about 5 s asks for a fraction of a worker to a few once the arrival
    # window sees it (how much depends on where the window starts), never hundreds (reading the 0 as a 1 ms
    # budget asked for thousands)...
    assert worker.settings.max_queue_time_s[-1] == 0.0

    def estimates(r) -> list[float]:
        return [s.desired_workers for s in r.statuses if s.desired_workers is not None]

    try:
        await collector.wait_until(lambda r: any(e >= 0.1 for e in estimates(r)), 15, "the burst in the estimate")
    except WaitTimeout as exc:
        raise AssertionError(f"{exc}; estimates {estimates(collector.results)}") from None
    assert max(estimates(collector.results)) < 20.0, estimates(collector.results)
    # ...and once it is served and the arrival window has passed, next to nothing.
    seen = len(collector.results.statuses)
    await collector.wait_until(lambda r: any(s.desired_workers is not None and s.desired_workers < 0.05
                                             for s in r.statuses[seen:]), 3 * ARRIVAL_WINDOW_S, "an idle estimate")
    status, body = _get(port, "/metrics")
    assert status == 200 and "llm_worker:desired_workers" in body


async def test_ready_once_joined(fleet):
    _, worker, _, port, _ = fleet
    assert worker.ready()
    assert _get(port, "/ready")[0] == 200


async def _result_headers(kafka: KafkaSettings, request_id: str, timeout_s: float = 30.0) -> list[tuple[str, list]]:
    """(kind, headers) of every result record of one request, read from the start of the result topic."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(kafka.result_topic, **kafka.client_kwargs(), auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    found = []
    try:
        async with asyncio.timeout(timeout_s):
            while not any(kind == "final" for kind, _ in found):
                for msgs in (await consumer.getmany(timeout_ms=200)).values():
                    for msg in msgs:
                        if msg.key == request_id.encode():
                            kind = "final" if msg.value.startswith(b'{"kind":"final"') else "chunk"
                            found.append((kind, list(msg.headers)))
    finally:
        await consumer.stop()
    return found


async def test_a_traceparent_continues_into_the_workers_spans_and_its_results(fleet):
    from confluent_kafka import Producer

    kafka, _, collector, _, spans = fleet
    trace_id, producer_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request = GenerationRequest(id="traced-1", prompt="hello trace", max_new_tokens=5)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    producer.produce(kafka.request_topic, value=encode(request), key=b"traced-1",
                     partition=partition_for(1, "traced-1", kafka.num_request_partitions, kafka.num_priorities),
                     headers=[("traceparent", f"00-{trace_id}-{producer_span_id}-01".encode())])
    assert producer.flush(10) == 0
    await collector.wait_until(lambda r: "traced-1" in r.finals, 30, "the traced request's final")
    records = await _result_headers(kafka, "traced-1")

    by_name = {}
    for span in spans.get_finished_spans():
        if span.context.trace_id == int(trace_id, 16):
            by_name[span.name] = span
    assert set(by_name) == {"llm.request", "queued", "admitted", "prefill", "decode", "publish"}, by_name
    root = by_name["llm.request"]
    assert root.parent.span_id == int(producer_span_id, 16)  # the producer's span is the worker's parent
    for name in ("queued", "admitted", "prefill", "decode", "publish"):
        assert by_name[name].parent.span_id == root.context.span_id
        assert by_name[name].start_time <= by_name[name].end_time
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.model"] == "instant"
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["gen_ai.request.max_tokens"] == 5
    # Every result record of the request carries the worker's span in the producer's trace.
    expected = ("traceparent", f"00-{trace_id}-{root.context.span_id:016x}-01".encode())
    assert [kind for kind, _ in records][-1] == "final"
    assert all(expected in headers for _, headers in records), records
    # A request without a traceparent: no spans, no headers.
    untraced = await _result_headers(kafka, "scale-0")
    assert untraced and all(headers == [] for _, headers in untraced)


PROMETHEUS = shutil.which("prometheus")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _query(prom_port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{prom_port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install prometheus; "
                    "`make setup` does it where apt is available)")
async def test_a_real_prometheus_scrapes_the_worker_and_evaluates_the_rules(fleet, tmp_path):
    _, _, _, port, _ = fleet
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "alerts.yaml")],
        "scrape_configs": [{"job_name": "llm-worker", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=log)
    try:
        desired = kv = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 40
        while not (desired and kv):
            assert loop.time() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
            try:
                # The KEDA trigger's query, and the KV alert's with its threshold lowered to match an idle worker.
                desired = (await asyncio.to_thread(_query, prom_port, "/api/v1/query",
                                                   query="avg(llm_worker:desired_workers)"))["result"]
                kv = (await asyncio.to_thread(_query, prom_port, "/api/v1/query",
                                              query="llm_worker:kv_cache_usage_perc > -1"))["result"]
            except OSError:
                continue  # not listening yet
        assert kv[0]["metric"]["instance"] == f"127.0.0.1:{port}" and kv[0]["metric"]["job"] == "llm-worker"
        assert float(desired[0]["value"][1]) >= 0.0
        deadline = loop.time() + 20
        while True:
            rules = [r for g in (await asyncio.to_thread(_query, prom_port, "/api/v1/rules"))["groups"]
                     for r in g["rules"]]
            if len(rules) == 6 and all(r.get("lastEvaluation", "").startswith("2") for r in rules):
                break
            assert loop.time() < deadline, rules
            await asyncio.sleep(0.5)
        assert all(r["health"] == "ok" for r in rules), rules
    finally:
        proc.terminate()
        proc.wait(10)
