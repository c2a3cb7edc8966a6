"""The gateway's cost: time to first token through the gateway vs our Python client, streamed requests per second
one gateway process sustains in front of the model-free engine, and a 10,000-line batch killed twice midway.

A local broker, one `llm-worker serve --engine instant` and one `llm-worker gateway`, each a process of its own.

1. TTFT: the same streamed requests (max_tokens 8), one at a time, alternately through LLMClient (submit to
   first chunk) and through the gateway over HTTP (POST to the first content event); medians and their
   difference.
2. Throughput: `--concurrency` HTTP clients send streamed requests (max_tokens 2) back to back for
   `--duration-s`; completed requests per second, and the gateway's CPU seconds per request.
3. Batch: `llm-worker batch run` of `--batch-lines` lines, SIGKILLed at a third and at two thirds of the
   answers, then run to the end; missing and duplicate custom_ids in the output.

    python -m benchmarks.bench_gateway    # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx2 as httpx

from benchmarks.bench_plumbing import process_cpu_s, start_broker
from producer_examples.client import BackoffPolicy, LLMClient
from schemas.request import ChatMessage, GenerationRequest
from worker.broker.local import free_ports
from worker.broker.topics import ensure_topics
from worker.config import KafkaSettings

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PREFIX = "bench.replies."


def settings(bootstrap: str) -> KafkaSettings:
    suffix = uuid.uuid4().hex[:8]
    return KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"bg.requests.{suffix}",
                         result_topic=f"bg.results.{suffix}", dead_letter_topic=f"bg.dlq.{suffix}",
                         status_topic=f"bg.status.{suffix}", control_topic=f"bg.control.{suffix}",
                         group_id=f"bg-{suffix}", allowed_reply_topic_prefixes=[PREFIX])


def env_of(kafka: KafkaSettings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "KAFKA_REQUEST_TOPIC": kafka.request_topic,
                "KAFKA_RESULT_TOPIC": kafka.result_topic, "KAFKA_DEAD_LETTER_TOPIC": kafka.dead_letter_topic,
                "KAFKA_STATUS_TOPIC": kafka.status_topic, "KAFKA_CONTROL_TOPIC": kafka.control_topic,
                "KAFKA_GROUP_ID": kafka.group_id, "KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES": json.dumps([PREFIX]),
                "GATEWAY_REPLY_TOPIC_PREFIX": PREFIX, "WORKER_METRICS_PORT": "0", "WORKER_MAX_ENGINE_INFLIGHT": "512",
                "ENGINE_MAX_NUM_SEQS": "256", **extra})
    return env


async def spawn(kafka: KafkaSettings, log: Path, *args: str, **extra: str):
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "worker.cli", *args, env=env_of(kafka, **extra),
                                                cwd=str(REPO), stdout=open(log, "ab"), stderr=asyncio.subprocess.STDOUT)


def body(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


async def gateway_ttft(http: httpx.AsyncClient, url: str, i: int) -> float:
    started = time.perf_counter()
    ttft = None
    async with http.stream("POST", url, json=body(i, 8)) as response:
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"content":"<' in line:
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("no content event")
    return ttft


async def client_ttft(client: LLMClient, i: int) -> float:
    request = GenerationRequest(id=f"c-{uuid.uuid4().hex[:12]}", messages=[ChatMessage(role="user",
                                content=f"question {i}")], max_new_tokens=8)
    started = time.perf_counter()
    handle = await client.submit(request, 1)
    ttft = None
    async for _ in handle.stream():
        if ttft is None:
            ttft = time.perf_counter() - started
    return ttft


async def ttft_phase(kafka: KafkaSettings, url: str, num: int) -> dict:
    gateway, direct = [], []
    async with LLMClient(kafka, backoff=BackoffPolicy(enabled=False)) as client, httpx.AsyncClient(timeout=60) as http:
        for i in range(5):  # warm both paths
            await gateway_ttft(http, url, i)
            await client_ttft(client, i)
        for i in range(num):
            if i % 2:
                gateway.append(await gateway_ttft(http, url, i))
                direct.append(await client_ttft(client, i))
            else:
                direct.append(await client_ttft(client, i))
                gateway.append(await gateway_ttft(http, url, i))
    g, d = statistics.median(gateway) * 1000, statistics.median(direct) * 1000
    return {"requests": num, "gateway_ttft_p50_ms": round(g, 2), "client_ttft_p50_ms": round(d, 2),
            "overhead_p50_ms": round(g - d, 2)}


async def throughput_phase(url: str, concurrency: int, duration_s: float, gateway_pid: int) -> dict:
    done = 0
    failed = 0
    stop_at = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one_client(http: httpx.AsyncClient, k: int) -> None:
        nonlocal done, failed
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            try:
                async with http.stream("POST", url, json=body(k * 1_000_000 + i, 2)) as response:
                    async for _ in response.aiter_lines():
                        pass
                    if response.status_code == 200:
                        done += 1
                    else:
                        failed += 1
            except httpx.HTTPError:
                failed += 1

    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        cpu0, t0 = process_cpu_s(gateway_pid), time.monotonic()
        await asyncio.gather(*(one_client(http, k) for k in range(concurrency)))
        cpu1, elapsed = process_cpu_s(gateway_pid), time.monotonic() - t0
    return {"concurrency": concurrency, "seconds": round(elapsed, 1), "completed": done, "failed": failed,
            "streamed_req_per_s": round(done / elapsed, 1),
            "gateway_cpu_ms_per_req": round((cpu1 - cpu0) * 1000 / max(done, 1), 2)}


async def batch_phase(kafka: KafkaSettings, tmp: Path, num_lines: int) -> dict:
    source, output = tmp / "batch.jsonl", tmp / "batch.out.jsonl"
    with open(source, "w") as f:
        for i in range(num_lines):
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {k: v for k, v in body(i, 4).items() if k != "stream"}}
            f.write(json.dumps(line) + "\n")

    def answered() -> int:
        return output.read_bytes().count(b"\n") if output.exists() else 0

    kills, started = [], time.monotonic()
    for fraction in (1 / 3, 2 / 3, None):
        process = await spawn(kafka, tmp / "batch.log", "batch", "run", str(source), "--output", str(output),
                              "--quiet")
        if fraction is not None:
            while answered() < fraction * num_lines and process.returncode is None:
                await asyncio.sleep(0.05)
            process.send_signal(signal.SIGKILL)
            kills.append(answered())
        await process.wait()
    ids = [json.loads(line)["custom_id"] for line in output.read_text().splitlines()]
    return {"lines": num_lines, "killed_at_answers": kills, "answers": len(ids),
            "missing": num_lines - len(set(ids)), "duplicates": len(ids) - len(set(ids)),
            "seconds_in_all": round(time.monotonic() - started, 1)}


async def main(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    bootstrap, broker = start_broker(tmp)
    worker = gateway = None
    try:
        kafka = settings(bootstrap)
        await ensure_topics(kafka)
        worker = await spawn(kafka, tmp / "worker.log", "serve", "--engine", "instant")
        (port,) = free_ports(1)
        gateway = await spawn(kafka, tmp / "gateway.log", "gateway", "--port", str(port))
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with httpx.AsyncClient() as http:
            for _ in range(600):
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        result = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count()}
        result["ttft"] = await ttft_phase(kafka, url, args.ttft_requests)
        result["throughput"] = await throughput_phase(url, args.concurrency, args.duration_s, gateway.pid)
        result["batch"] = await batch_phase(kafka, tmp, args.batch_lines)
        result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
        return result
    finally:
        for process in (gateway, worker):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
        broker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--batch-lines", type=int, default=10_000)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "gateway.json")
    cli = parser.parse_args()
    outcome = asyncio.run(main(cli))
    print(json.dumps(outcome, indent=2))
    cli.json.parent.mkdir(parents=True, exist_ok=True)
    cli.json.write_text(json.dumps(outcome, indent=2))
