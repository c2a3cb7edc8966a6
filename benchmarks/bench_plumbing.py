"""Plumbing benchmark: requests per second one worker sustains through Kafka when compute is free.

Pre-loads N requests into a fresh request topic, starts `llm-worker serve --engine instant` as a separate
process (as in production), and times the final records on the result topic: sustained rate = finals between
the 10th and the 90th percentile of arrival / the time between them, so start-up and the tail do not count.
Uses KAFKA_BOOTSTRAP_SERVERS / --bootstrap, else starts a local broker in a temporary folder.

    .venv/bin/python benchmarks/bench_plumbing.py --num-requests 50000   # JSON: benchmarks/results/raw/plumbing.json

`--exactly-once on,off` runs every case with finals in transactions (KAFKA_EXACTLY_ONCE, read with
isolation.level=read_committed) and without, alternately in one run, and adds a light-load case (requests at
`--latency-rate` per second) whose median produce-to-final time shows what the transactions add to a final.

`--security plaintext,sasl_ssl` does the same for the listener: one local broker per mode (`sasl_ssl`, `ssl` for
mutual TLS, `sasl_plaintext`, as `llm-worker broker start --security` makes them), the worker connecting as the
`worker` principal and the benchmark's producer and reader as `client`, each limited by its ACLs (fresh topics get
theirs from `admin`). Every case runs in each mode, alternately, and the table ends with each secured mode's
rates as a fraction of plaintext's.

    .venv/bin/python benchmarks/bench_plumbing.py --num-requests 20000 --security plaintext,sasl_ssl
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
from worker.kafka_settings import KafkaSettings  # noqa: E402
from benchmarks.lib.broker_target import Target, start_broker  # noqa: E402


async def preload(kafka: KafkaSettings, num_requests: int, max_new_tokens: int, stream: bool) -> float:
    """kafka: the client's settings."""
    producer = AIOKafkaProducer(**kafka.client_kwargs(), linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    started = time.perf_counter()
    try:
        futures = []
        for i in range(num_requests):
            rid = f"b-{i}"
            req = GenerationRequest(id=rid, prompt=f"benchmark prompt {i}", max_new_tokens=max_new_tokens,
                                    stream=stream)
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
                                enable_auto_commit=False, group_id=None, isolation_level=isolation(kafka))
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


def isolation(kafka: KafkaSettings) -> str:
    return "read_committed" if kafka.exactly_once else "read_uncommitted"


def worker_env(kafka: KafkaSettings, target: Target | None = None) -> dict[str, str]:
    env = dict(os.environ, **(target.env("worker") if target else {}))
    return dict(env, KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers, KAFKA_REQUEST_TOPIC=kafka.request_topic,
                KAFKA_RESULT_TOPIC=kafka.result_topic, KAFKA_DEAD_LETTER_TOPIC=kafka.dead_letter_topic,
                KAFKA_STATUS_TOPIC=kafka.status_topic, KAFKA_GROUP_ID=kafka.group_id,
                KAFKA_CONTROL_TOPIC=kafka.control_topic, KAFKA_EXACTLY_ONCE=str(kafka.exactly_once).lower(),
                WORKER_METRICS_PORT="0", WORKER_MAX_POLL_RECORDS="2000", WORKER_MAX_WAITING="4000",
                WORKER_RESUME_WAITING="2000", ENGINE_MAX_NUM_SEQS="512",
                # A preloaded backlog is the point here, not an overload: nothing is shed for lag.
                WORKER_MAX_QUEUE_TIME_S="[1000000.0, 1000000.0, 1000000.0]")


def fresh_settings(bootstrap: str, exactly_once: bool) -> KafkaSettings:
    suffix = uuid.uuid4().hex[:8]
    return KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"bench.requests.{suffix}",
                         result_topic=f"bench.results.{suffix}", dead_letter_topic=f"bench.dlq.{suffix}",
                         status_topic=f"bench.status.{suffix}", control_topic=f"bench.control.{suffix}",
                         group_id=f"bench-{suffix}", exactly_once=exactly_once)


async def start_worker(kafka: KafkaSettings, target: Target | None = None):
    log = open(Path(tempfile.gettempdir()) / f"bench-worker-{kafka.group_id}.log", "wb")
    return await asyncio.create_subprocess_exec(str(REPO / ".venv/bin/llm-worker"), "serve", "--engine", "instant",
                                                env=worker_env(kafka, target), stdout=log, stderr=log)


async def latency_case(target: Target, exactly_once: bool, num_requests: int, rate: float, timeout_s: float) -> dict:
    """Requests at `rate` per second once the worker serves: produce-to-final time of each (ms)."""
    kafka = fresh_settings(target.bootstrap, exactly_once)
    await target.prepare(kafka)
    proc = await start_worker(kafka, target)
    client = target.as_("client", kafka)
    consumer = AIOKafkaConsumer(kafka.result_topic, **client.client_kwargs(), auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None, isolation_level=isolation(kafka))
    producer = AIOKafkaProducer(**client.client_kwargs())
    await consumer.start()
    await producer.start()
    sent: dict[str, float] = {}
    got: dict[str, float] = {}

    async def read() -> None:
        while len(got) < len(sent) or len(sent) < num_requests:
            for msgs in (await consumer.getmany(timeout_ms=50)).values():
                for msg in msgs:
                    if b'"kind":"final"' in msg.value:
                        got.setdefault(msg.key.decode(), time.monotonic())

    async def send(rid: str) -> None:
        req = GenerationRequest(id=rid, prompt=f"latency {rid}", max_new_tokens=4)
        partition = partition_for(1, rid, kafka.num_request_partitions, kafka.num_priorities)
        sent[rid] = time.monotonic()
        await producer.send_and_wait(kafka.request_topic, encode(req), key=rid.encode(), partition=partition)

    reader = asyncio.create_task(read())
    try:
        await send("warm-up")  # the worker joins the group and starts its transactional producers first
        async with asyncio.timeout(timeout_s):
            while "warm-up" not in got:
                await asyncio.sleep(0.05)
        del sent["warm-up"], got["warm-up"]
        for i in range(num_requests):
            await send(f"l-{i}")
            await asyncio.sleep(1.0 / rate)
        await asyncio.wait_for(reader, timeout_s)
    finally:
        reader.cancel()
        await producer.stop()
        await consumer.stop()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    times = sorted((got[r] - sent[r]) * 1000.0 for r in sent)
    return {"security": target.mode, "exactly_once": exactly_once, "num_requests": len(times), "rate": rate,
            "final_p50_ms": round(times[len(times) // 2], 1), "final_p90_ms": round(times[(9 * len(times)) // 10], 1)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_case(target: Target, num_requests: int, max_new_tokens: int, stream: bool, timeout_s: float,
                   exactly_once: bool = False) -> dict:
    kafka = fresh_settings(target.bootstrap, exactly_once)
    await target.prepare(kafka)
    client = target.as_("client", kafka)
    produce_rate = await preload(client, num_requests, max_new_tokens, stream)
    started = time.monotonic()
    proc = await start_worker(kafka, target)
    try:
        arrivals, num_chunks, cpu_at = await count_finals(client, num_requests, timeout_s, proc.pid)
        # Whole-run figures too: with exactly-once, finals become visible a transaction at a time, in bursts,
        # which the 10-90 % window of arrivals overstates.
        total_cpu_s = process_cpu_s(proc.pid)
        total_wall_s = (arrivals[-1] if arrivals else time.monotonic()) - started
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = await proc.wait()
    n = len(arrivals)
    first, last = (n // 10, (9 * n) // 10 - 1) if n >= 20 else (0, n - 1)
    lo, hi = arrivals[first], arrivals[last]
    sustained = (last - first) / (hi - lo) if hi > lo else float("nan")
    cpu_used = cpu_at[last] - cpu_at[first] if first in cpu_at and last in cpu_at else None
    return {
        "security": target.mode, "exactly_once": exactly_once,
        "num_requests": num_requests, "max_new_tokens": max_new_tokens, "stream": stream, "num_completed": n,
        "num_chunks": num_chunks, "sustained_req_per_s": round(sustained, 1),
        "overall_req_per_s": round(n / (arrivals[-1] - arrivals[0]), 1) if n > 1 else None,
        "preload_req_per_s": round(produce_rate, 1), "worker_exit_code": exit_code,
        # Requests per CPU second of the worker process (all threads) between the 10% and 90% marks: a figure
        # that other load on the machine distorts less than wall-clock rates (CPU-time accounting stays fair).
        "req_per_worker_cpu_s": round((last - first) / cpu_used, 1) if cpu_used else None,
        # From the worker's start (its start-up included) to the last final: the figure to compare modes by.
        "wall_s_to_last_final": round(total_wall_s, 2), "worker_cpu_s": round(total_cpu_s, 2),
        "req_per_wall_s": round(n / total_wall_s, 1) if total_wall_s > 0 else None,
        # Whole run per CPU second of the worker: what one request costs it, bursts and start-up included.
        "req_per_worker_cpu_s_total": round(n / total_cpu_s, 1) if total_cpu_s > 0 else None,
    }


async def main(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-plumbing-"))
    securities = args.security.split(",")
    if args.bootstrap and securities != ["plaintext"]:
        raise SystemExit("--security other than plaintext starts its own brokers: leave out --bootstrap")
    bootstrap = args.bootstrap or (os.environ.get("KAFKA_BOOTSTRAP_SERVERS") if securities == ["plaintext"] else None)
    targets = [Target("plaintext", bootstrap)] if bootstrap else []
    try:
        if not targets:
            # All brokers up before the first case, so that the cases can alternate between them.
            targets = [await asyncio.to_thread(start_broker, tmp, mode) for mode in securities]
        cases = [(args.num_requests, 1, False), (args.num_requests // 2, 4, True)]
        modes = [(target, m == "on") for m in args.exactly_once.split(",") for target in targets]
        rows = []
        for _ in range(args.reps):
            for i, (n, t, s) in enumerate(cases):
                for target, mode in (modes if i % 2 == 0 else modes[::-1]):  # alternate the order: drift hits all
                    rows.append(await run_case(target, n, t, s, args.timeout_s, mode))
                    print(row_line(rows[-1]), flush=True)
        if len(modes) > 1:
            for target, mode in modes + modes[::-1]:
                rows.append(await latency_case(target, mode, args.latency_requests, args.latency_rate,
                                               args.timeout_s))
                print(row_line(rows[-1]), flush=True)
        return rows
    finally:
        for target in targets:
            target.stop()


def row_line(row: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in row.items())


def security_ratios(rows: list[dict]) -> list[dict]:
    """Each secured mode's median rates over plaintext's, per case (same tokens, stream and exactly-once)."""
    import statistics

    def case(row: dict) -> tuple:
        return (row["exactly_once"], row.get("max_new_tokens"), row.get("stream"), row.get("rate"))

    out = []
    for key in sorted({case(r) for r in rows}, key=str):
        same = [r for r in rows if case(r) == key]
        base = [r for r in same if r["security"] == "plaintext"]
        for mode in sorted({r["security"] for r in same} - {"plaintext"}):
            secured = [r for r in same if r["security"] == mode]
            if not base or not secured:
                continue
            entry = {"security": mode, "exactly_once": key[0], "max_new_tokens": key[1], "stream": key[2]}
            for metric in ("sustained_req_per_s", "overall_req_per_s", "req_per_wall_s", "req_per_worker_cpu_s_total",
                           "final_p50_ms"):
                b = [r[metric] for r in base if r.get(metric)]
                v = [r[metric] for r in secured if r.get(metric)]
                if b and v:
                    entry[f"{metric}_ratio"] = round(statistics.median(v) / statistics.median(b), 3)
            out.append(entry)
    return out


def print_table(rows: list[dict]) -> None:
    for kind in ("sustained_req_per_s", "final_p50_ms", "sustained_req_per_s_ratio", "final_p50_ms_ratio"):
        chosen = [row for row in rows if kind in row]
        if not chosen:
            continue
        cols = list(chosen[0])
        print(" | ".join(cols))
        print(" | ".join("---" for _ in cols))
        for row in chosen:
            print(" | ".join(str(row.get(c, "")) for c in cols))
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap")
    parser.add_argument("--num-requests", type=int, default=50_000)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--exactly-once", default="on", help="on, off, or on,off (both, alternately)")
    parser.add_argument("--security", default="plaintext",
                        help="plaintext, sasl_ssl, ssl, sasl_plaintext, or several (e.g. plaintext,sasl_ssl: "
                             "a broker each, cases alternating)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of every case")
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--latency-rate", type=float, default=20.0)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "plumbing.json")
    cli = parser.parse_args()
    load_before = os.getloadavg()
    table = asyncio.run(main(cli))
    ratios = security_ratios(table) if "," in cli.security else []
    print_table(table + ratios)
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; {os.cpu_count()} CPUs")
    cli.json.parent.mkdir(parents=True, exist_ok=True)
    cli.json.write_text(json.dumps({"machine_cpus": os.cpu_count(), "load_before": load_before,
                                    "load_after": os.getloadavg(), "args": vars(cli) | {"json": str(cli.json)},
                                    "results": table, "security_ratios": ratios}, indent=2))
