"""What metrics and tracing cost on the Kafka path: bench_plumbing's worker (`llm-worker serve --engine
instant`, compute free, so the transport is all there is) on the same preloaded requests, every one with a
`traceparent` header, in ABBA order within one run:

- off: no metrics endpoint, no tracing (the headers are there but nothing reads them). The worker keeps its
  metrics in process either way (one counter and four histogram updates per final, about 0.75 us): "metrics
  on" here is the endpoint and its scrapes, and the baseline already pays the updates;
- on: the metrics endpoint scraped every second, and tracing on: every request's context read and carried on
  its results; the producer samples --sample of the traces (the traceparent's sampled flag; 1 samples all,
  the worst case), which the worker records and exports over OTLP/HTTP in batches to a local sink that
  accepts and discards them.

Reports sustained finals per second (10th-90th percentile of arrivals) and requests per CPU second of the
worker (less distorted by other load on a shared machine), and on / off for both.

    .venv/bin/python -m benchmarks.bench_tracing --num-requests 20000 --sample 0.01   # results/<date>-tracing/

`--micro` measures the tracing code alone, without Kafka or a worker: microseconds per request for a record
without a traceparent, an unsampled one and a sampled one (its `begin`, its chunk's and final's headers, and
its spans handed to an in-memory processor), and per span for the OTLP encoding, the worker's and the SDK's.

    .venv/bin/python -m benchmarks.bench_tracing --micro
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from aiokafka import AIOKafkaProducer

from benchmarks.bench_plumbing import count_finals
from schemas.decode import encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from worker.broker.net import free_port
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def start_broker(folder: Path) -> tuple[str, object]:
    """A plaintext LocalBroker on free ports: this benchmark compares the worker with itself, not listeners."""
    from worker.broker.local import LocalBroker, free_ports

    port, controller_port = free_ports(2)
    broker = LocalBroker(folder / "broker", port, controller_port, detach=False)
    broker.start()
    return broker.bootstrap_servers, broker


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts every export and keeps only counts."""

    received = 0

    def do_POST(self):  # http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format, *args):
        pass


async def preload(kafka: KafkaSettings, num_requests: int, sample: float) -> None:
    """Every record carries a traceparent; `sample` of them (every 1/sample-th) with the sampled flag."""
    every = max(1, round(1 / sample)) if sample > 0 else 0
    producer = AIOKafkaProducer(**kafka.client_kwargs(), linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    try:
        futures = []
        for i in range(num_requests):
            rid = f"t-{i}"
            req = GenerationRequest(id=rid, prompt=f"benchmark prompt {i}", max_new_tokens=1)
            partition = partition_for(i % kafka.num_priorities, rid, kafka.num_request_partitions, kafka.num_priorities)
            flags = "01" if every and i % every == 0 else "00"
            traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{flags}".encode()
            futures.append(await producer.send(kafka.request_topic, encode(req), key=rid.encode(), partition=partition,
                                               headers=[("traceparent", traceparent)]))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _scrape(port: int, stop: asyncio.Event) -> int:
    n = 0
    while not stop.is_set():
        try:
            await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read())
            n += 1
        except OSError:
            pass  # not listening yet
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    return n


async def run_case(bootstrap: str, num_requests: int, on: bool, sink_port: int, timeout_s: float,
                   sample: float, parts: str = "both") -> dict:
    suffix = uuid.uuid4().hex[:8]
    kafka = KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"bench.requests.{suffix}",
                          result_topic=f"bench.results.{suffix}", dead_letter_topic=f"bench.dlq.{suffix}",
                          status_topic=f"bench.status.{suffix}", group_id=f"bench-{suffix}")
    await ensure_topics(kafka)
    await preload(kafka, num_requests, sample)
    metrics_port = free_port() if on and parts in ("both", "metrics") else 0
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, KAFKA_REQUEST_TOPIC=kafka.request_topic,
               KAFKA_RESULT_TOPIC=kafka.result_topic, KAFKA_DEAD_LETTER_TOPIC=kafka.dead_letter_topic,
               KAFKA_STATUS_TOPIC=kafka.status_topic, KAFKA_GROUP_ID=kafka.group_id,
               WORKER_METRICS_PORT=str(metrics_port), WORKER_MAX_POLL_RECORDS="2000", WORKER_MAX_WAITING="4000",
               WORKER_RESUME_WAITING="2000", ENGINE_MAX_NUM_SEQS="512", OMP_NUM_THREADS="1",
               # Finals through the publisher rather than in transactions: the lighter path, where a fixed
               # per-record cost shows most.
               KAFKA_EXACTLY_ONCE="false",
               # The preloaded backlog is the benchmark, not an overload: never shed it.
               WORKER_MAX_QUEUE_TIME_S="[1e6, 1e6, 1e6]")
    for name in list(env):
        if name.startswith("OTEL_"):
            del env[name]
    if on and parts in ("both", "tracing"):
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}", OTEL_SERVICE_NAME="bench-worker")
    log = open(Path(tempfile.gettempdir()) / f"bench-tracing-{suffix}.log", "wb")
    proc = await asyncio.create_subprocess_exec(str(REPO / ".venv/bin/llm-worker"), "serve", "--engine", "instant",
                                                env=env, stdout=log, stderr=log)
    stop = asyncio.Event()
    scraper = asyncio.create_task(_scrape(metrics_port, stop)) if metrics_port else None
    exports_before = _Sink.received
    try:
        arrivals, _, cpu_at = await count_finals(kafka, num_requests, timeout_s, proc.pid)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    scrapes = await scraper if scraper else 0
    n = len(arrivals)
    first, last = n // 10, (9 * n) // 10 - 1
    sustained = (last - first) / (arrivals[last] - arrivals[first])
    cpu = cpu_at[last] - cpu_at[first] if first in cpu_at and last in cpu_at else None
    return {"on": on, "num_completed": n, "sustained_req_per_s": round(sustained, 1),
            "req_per_worker_cpu_s": round((last - first) / cpu, 1) if cpu else None,
            "scrapes": scrapes, "otlp_exports": _Sink.received - exports_before}


async def main(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    bootstrap, broker = start_broker(tmp)
    sink = ThreadingHTTPServer(("127.0.0.1", free_port()), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    try:
        order = [False, True, True, False] * args.rounds
        runs = [await run_case(bootstrap, args.num_requests, on, sink.server_address[1], args.timeout_s, args.sample,
                                 args.parts)
                for on in order]
    finally:
        sink.shutdown()
        broker.stop()
    summary = {}
    for key in ("sustained_req_per_s", "req_per_worker_cpu_s"):
        on = statistics.median(r[key] for r in runs if r["on"])
        off = statistics.median(r[key] for r in runs if not r["on"])
        summary[key] = {"on": on, "off": off, "on_over_off": round(on / off, 3)}
    return {"num_requests": args.num_requests, "sample": args.sample, "parts": args.parts, "loadavg_before": loadavg,
            "loadavg_after": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count(),
            "runs": runs, "summary": summary}


def micro(n: int = 20_000) -> dict:
    from types import SimpleNamespace

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from schemas.result import FinalRecord, Usage
    from worker.transport.requests.otlp import encode_request
    from worker.transport.requests.tracing import RequestTracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = RequestTracing(provider.get_tracer("kafka-llm-worker"), "model")
    queued = SimpleNamespace(request=GenerationRequest(id="r", prompt="p", max_new_tokens=1), offset=5, priority=1,
                             partition=SimpleNamespace(topic="llm.requests", partition=3), attempt=1,
                             timestamp_ms=time.time() * 1000)
    now = time.monotonic()
    out = SimpleNamespace(arrival_time=now, first_scheduled_time=now, first_token_time=now, finish_time=now)
    final = encode(FinalRecord(id="r", status="completed", reason="length", finish_reason="length",
                               usage=Usage(prompt_tokens=5, completion_tokens=1)))
    chunk = b'{"kind":"chunk","id":"r"}'
    keys = [f"k{i}".encode() for i in range(n)]

    def headers(flags: str) -> list:
        return [[("traceparent", f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{flags}".encode())] for _ in keys]

    def requests(all_headers: list, count: int) -> None:
        for i in range(count):
            trace = tracing.begin(all_headers[i], keys[i], queued)
            if trace is not None:
                trace.engine_done(out)
            tracing.headers_for(keys[i], chunk)
            tracing.headers_for(keys[i], final)

    def best_us(run, count: int) -> float:
        run(min(count, 200))
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            run(count)
            best = min(best, (time.perf_counter() - started) / count * 1e6)
        return round(best, 2)

    result = {"untraced_us": best_us(lambda c: requests([[]] * n, c), n),
              "unsampled_us": best_us(lambda c, h=headers("00"): requests(h, c), n),
              "sampled_us": best_us(lambda c, h=headers("01"): requests(h, c), n // 10)}
    spans = list(exporter.get_finished_spans())[-3072:]
    for name, encoder in (("encode_worker_us_per_span", encode_request),
                          ("encode_sdk_us_per_span", lambda s: encode_spans(s).SerializePartialToString())):
        result[name] = best_us(lambda c, e=encoder: [e(spans[i:i + 512]) for i in range(0, c, 512)], len(spans))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds (off, on, on, off each)")
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--sample", type=float, default=0.01,
                        help="share of requests whose traceparent has the sampled flag; 1 = all")
    parser.add_argument("--parts", choices=["both", "tracing", "metrics"], default="both",
                        help="what `on` turns on (both is the floor's case; the others split its cost)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--micro", action="store_true", help="the tracing code alone, per request (no Kafka)")
    cli = parser.parse_args()
    if cli.micro:
        print(json.dumps(micro()), "loadavg", Path("/proc/loadavg").read_text().split()[:3])
        raise SystemExit(0)
    cli.out = cli.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-tracing-{cli.parts}-sample{cli.sample:g}"
    result = asyncio.run(main(cli))
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / "summary.json").write_text(json.dumps(result, indent=1))
    for run in result["runs"]:
        print(run)
    print(json.dumps(result["summary"]), "loadavg", result["loadavg_before"], "->", result["loadavg_after"])
