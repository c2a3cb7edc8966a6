"""Plumbing benchmark: requests per second one worker sustains through Kafka when compute is free.

Pre-loads N requests into a fresh request topic, starts `llm-worker serve --engine instant` as a separate
process (as in production), and times the final records on the result topic: sustained rate = finals between
the 10th and the 90th percentile of arrival / the time between them, so start-up and the tail do not count.
Uses KAFKA_BOOTSTRAP_SERVERS / --bootstrap, else starts a local broker in a temporary folder.

    .venv/bin/python benchmarks/bench_plumbing.py --num-requests 50000   # JSON: benchmarks/results/raw/plumbing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schemas.decode import decode_result, encode  # noqa: E402
from schemas.priority import partition_for  # noqa: E402
from schemas.request import GenerationRequest  # noqa: E402
from schemas.result import FinalRecord  # noqa: E402
from worker.broker.topics import ensure_topics  # noqa: E402
from worker.config import KafkaSettings  # noqa: E402


async def preload(kafka: KafkaSettings, num_requests: int, max_new_tokens: int, stream: bool) -> float:
    producer = AIOKafkaProducer(**kafka.client_kwargs(), linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    started = time.perf_counter()
    try:
        futures = []
        for i in range(num_requests):
            rid = f"b-{i}"
            req = GenerationRequest(id=rid, prompt=f"benchmark prompt {i}", max_new_tokens=max_new_tokens, stream=stream)
            partition = partition_for(i % kafka.num_priorities, rid, kafka.num_request_partitions, kafka.num_priorities)
            futures.append(await producer.send(kafka.request_topic, encode(req), key=rid.encode(), partition=partition))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return num_requests / (time.perf_counter() - started)


async def count_finals(kafka: KafkaSettings, num_requests: int, timeout_s: float,
                       pid: int | None = None) -> tuple[list[float], int, dict[int, float]]:
    """Arrival times of the final records, the number of chunks, and the worker's CPU seconds sampled when
    the 10% and the 90% marks of finals arrived."""
    consumer = AIOKafkaConsumer(kafka.result_topic, **kafka.client_kwargs(), auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    arrivals: list[float] = []
    num_chunks = 0
    marks = {num_requests // 10, (9 * num_requests) // 10 - 1}
    cpu_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(arrivals) < num_requests and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=10_000)
            now = time.monotonic()
            for msgs in batches.values():
                for msg in msgs:
                    # Cheap test first: decoding 50k records fully would slow the counter, not the worker.
                    if b'"kind":"final"' in msg.value:
                        # Decode every 100th in full: the counter shares the CPUs with the worker it measures.
                        if len(arrivals) % 100 == 0:
                            record = decode_result(msg.value)
                            assert isinstance(record, FinalRecord) and record.status == "completed", record
                        elif b'"status":"completed"' not in msg.value:
                            raise AssertionError(msg.value)
                        if pid is not None and len(arrivals) in marks:
                            cpu_at[len(arrivals)] = process_cpu_s(pid)
                        arrivals.append(now)
                    else:
                        num_chunks += 1
    finally:
        await consumer.stop()
    return arrivals, num_chunks, cpu_at


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_broker(tmp: Path) -> tuple[str, object]:
    from worker.broker.local import LocalBroker, free_ports

    port, controller_port = free_ports(2)
    broker = LocalBroker(tmp / "broker", port, controller_port, detach=False)
    broker.start()
    return broker.bootstrap_servers, broker


async def run_case(bootstrap: str, num_requests: int, max_new_tokens: int, stream: bool, timeout_s: float) -> dict:
    suffix = uuid.uuid4().hex[:8]
    kafka = KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"bench.requests.{suffix}",
                          result_topic=f"bench.results.{suffix}", dead_letter_topic=f"bench.dlq.{suffix}",
                          status_topic=f"bench.status.{suffix}", group_id=f"bench-{suffix}")
    await ensure_topics(kafka)
    produce_rate = await preload(kafka, num_requests, max_new_tokens, stream)
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, KAFKA_REQUEST_TOPIC=kafka.request_topic,
               KAFKA_RESULT_TOPIC=kafka.result_topic, KAFKA_DEAD_LETTER_TOPIC=kafka.dead_letter_topic,
               KAFKA_STATUS_TOPIC=kafka.status_topic, KAFKA_GROUP_ID=kafka.group_id, WORKER_METRICS_PORT="0",
               WORKER_MAX_POLL_RECORDS="2000", WORKER_MAX_WAITING="4000", WORKER_RESUME_WAITING="2000",
               ENGINE_MAX_NUM_SEQS="512")
    log = open(Path(tempfile.gettempdir()) / f"bench-worker-{suffix}.log", "wb")
    proc = await asyncio.create_subprocess_exec(str(REPO / ".venv/bin/llm-worker"), "serve", "--engine", "instant",
                                                env=env, stdout=log, stderr=log)
    try:
        arrivals, num_chunks, cpu_at = await count_finals(kafka, num_requests, timeout_s, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = await proc.wait()
    n = len(arrivals)
    first, last = (n // 10, (9 * n) // 10 - 1) if n >= 20 else (0, n - 1)
    lo, hi = arrivals[first], arrivals[last]
    sustained = (last - first) / (hi - lo) if hi > lo else float("nan")
    cpu_used = cpu_at[last] - cpu_at[first] if first in cpu_at and last in cpu_at else None
    return {
        "num_requests": num_requests, "max_new_tokens": max_new_tokens, "stream": stream, "num_completed": n,
        "num_chunks": num_chunks, "sustained_req_per_s": round(sustained, 1),
        "overall_req_per_s": round(n / (arrivals[-1] - arrivals[0]), 1) if n > 1 else None,
        "preload_req_per_s": round(produce_rate, 1), "worker_exit_code": exit_code,
        # Requests per CPU second of the worker process (all threads) between the 10% and 90% marks: a figure
        # that other load on the machine distorts less than wall-clock rates (CPU-time accounting stays fair).
        "req_per_worker_cpu_s": round((last - first) / cpu_used, 1) if cpu_used else None,
    }


async def main(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-plumbing-"))
    bootstrap, broker = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), None
    if not bootstrap:
        bootstrap, broker = start_broker(tmp)
    try:
        cases = [(args.num_requests, 1, False), (args.num_requests // 2, 4, True)]
        return [await run_case(bootstrap, n, t, s, args.timeout_s) for n, t, s in cases]
    finally:
        if broker is not None:
            broker.stop()


def print_table(rows: list[dict]) -> None:
    cols = ["num_requests", "max_new_tokens", "stream", "num_completed", "num_chunks", "sustained_req_per_s",
            "overall_req_per_s", "req_per_worker_cpu_s", "preload_req_per_s", "worker_exit_code"]
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap")
    parser.add_argument("--num-requests", type=int, default=50_000)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "plumbing.json")
    cli = parser.parse_args()
    table = asyncio.run(main(cli))
    print_table(table)
    cli.json.parent.mkdir(parents=True, exist_ok=True)
    cli.json.write_text(json.dumps({"machine_cpus": os.cpu_count(), "results": table}, indent=2))
