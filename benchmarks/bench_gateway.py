"""The gateway's cost: time to first token through the gateway vs our Python client, streamed requests per second
one gateway process sustains in front of the model-free engine, and a 10,000-line batch killed twice midway.

A local broker, one `llm-worker serve --engine instant` and one `llm-worker gateway`, each a process of its own.

1. TTFT: the same streamed requests (max_tokens 8), one at a time, alternately through LLMClient (submit to
   first chunk) and through the gateway over HTTP (POST to the first content event); medians and their
   difference.
2. Throughput: `--concurrency` connections send streamed requests (max_tokens 2) back to back for
   `--duration-s` (after a warm-up); completed requests per second, and the CPU milliseconds per request of
   each process (gateway, worker, broker, the load generator) and of the whole machine. The load generator is
   a lean asyncio HTTP/1.1 keep-alive client (`--client raw`; httpx, `--client httpx`, costs more CPU per
   request than the gateway). `--py-spy DIR` records the gateway and the worker meanwhile.
3. Batch: `llm-worker batch run` of `--batch-lines` lines, SIGKILLed at a third and at two thirds of the
   answers, then run to the end; missing and duplicate custom_ids in the output.
4. Keys (`--phases keys`): the throughput and TTFT of a gateway with API keys against the open one, in
   alternating rounds (keys_phase).
5. Upload: does a large upload stall the streams? A gateway of its own (`GATEWAY_MAX_UPLOAD_BYTES` =
   `--upload-limit-mib`) in front of a worker whose instant engine takes `--upload-step-ms` a token:
   `--upload-streams` streamed chat requests of `--upload-max-tokens` tokens at once, alone, then again while
   a chunked upload of `--upload-mib` goes in (from a thread of its own, as fast as the gateway reads it).
   The gaps between consecutive chunks of every stream (alone, and those that end while the upload is
   received) with the ratio of their medians, and the time from the upload passing the limit to its 413.

    python -m benchmarks.bench_gateway    # about 3 minutes on 2 cores
    python -m benchmarks.bench_gateway --phases throughput --concurrency 256 --duration-s 15
    python -m benchmarks.bench_gateway --phases upload    # about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx2 as httpx

from benchmarks.bench_plumbing import process_cpu_s
from benchmarks.lib.broker_target import start_broker
from llm_client import BackoffPolicy, LLMClient
from schemas.request import ChatMessage, GenerationRequest
from worker.broker.local import free_ports
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings

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


async def gateway_ttft(http: httpx.AsyncClient, url: str, i: int, api_key: str | None = None) -> float:
    started = time.perf_counter()
    ttft = None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    async with http.stream("POST", url, json=body(i, 8), headers=headers) as response:
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


def cpu_s(pid: int | None) -> float:
    return process_cpu_s(pid) if pid is not None else 0.0


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat: how loaded the cores were
    (other work on a shared machine shows up here and in no process of ours)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


class RawStream:
    """A lean HTTP/1.1 keep-alive client for streamed answers: one connection, one request at a time, the
    chunked body read and dropped, only the status and the `data: [DONE]` ending checked. httpx costs the
    client several times what the gateway spends on a request, and on a small machine the load generator
    shares the cores with what it measures."""

    def __init__(self, host: str, port: int, path: str, api_key: str | None = None) -> None:
        self.host, self.port = host, port
        auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
        self.head = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n{auth}"
                     "content-length: ").encode()
        self.reader = self.writer = None

    async def post(self, payload: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.head + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        last = b""
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                last = (await self.reader.readexactly(size + 2))[:-2]
        else:
            start = lower.index(b"content-length:") + 15
            last = await self.reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
        if b"connection: close" in lower:
            await self.close()
        if status == 200 and not last.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"a stream that does not end with [DONE]: {last[-80:]!r}")
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def throughput_phase(url: str, concurrency: int, duration_s: float, pids: dict[str, int | None],
                           client: str = "raw", warmup_s: float = 3.0, py_spy: Path | None = None,
                           api_key: str | None = None) -> dict:
    """Streamed requests back to back from `concurrency` connections; after `warmup_s`, for `duration_s`:
    completed requests per second and CPU ms per request of each process (gateway, worker, broker, this
    load generator) and of the whole machine."""
    done = failed = 0
    measuring = False
    stop = asyncio.Event()
    parsed = httpx.URL(url)

    async def raw_client(k: int) -> None:
        nonlocal done, failed
        http = RawStream(parsed.host, parsed.port, parsed.path, api_key)
        i = 0
        try:
            while not stop.is_set():
                i += 1
                try:
                    ok = await http.post(json.dumps(body(k * 1_000_000 + i, 2)).encode()) == 200
                except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError):
                    ok = False
                    await http.close()
                if measuring:
                    done, failed = done + ok, failed + (not ok)
        finally:
            await http.close()

    async def httpx_client(http: httpx.AsyncClient, k: int) -> None:
        nonlocal done, failed
        i = 0
        while not stop.is_set():
            i += 1
            try:
                async with http.stream("POST", url, json=body(k * 1_000_000 + i, 2)) as response:
                    async for _ in response.aiter_lines():
                        pass
                    ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if measuring:
                done, failed = done + ok, failed + (not ok)

    pids = dict(pids, client=os.getpid())
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        tasks = [asyncio.create_task(raw_client(k) if client == "raw" else httpx_client(http, k))
                 for k in range(concurrency)]
        await asyncio.sleep(warmup_s)
        spies = []
        if py_spy is not None:
            py_spy.mkdir(parents=True, exist_ok=True)
            for name in ("gateway", "worker"):
                spies.append(await asyncio.create_subprocess_exec(
                    str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "--rate", "200",
                    "--format", "raw", "--duration", str(int(duration_s)), "--pid", str(pids[name]),
                    "--output", str(py_spy / f"{name}.txt"), stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL))
        cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
        busy0, total0 = machine_busy_s()
        t0 = time.monotonic()
        measuring = True
        await asyncio.sleep(duration_s)
        measuring = False
        elapsed = time.monotonic() - t0
        cpu1 = {name: cpu_s(pid) for name, pid in pids.items()}
        busy1, total1 = machine_busy_s()
        loadavg = Path("/proc/loadavg").read_text().split()[:3]
        stop.set()
        await asyncio.gather(*tasks)
        for spy in spies:
            await spy.wait()
    per_req = {name: round((cpu1[name] - cpu0[name]) * 1000 / max(done, 1), 3) for name in pids}
    gateway_ms = per_req["gateway"]
    return {"client": client, "concurrency": concurrency, "seconds": round(elapsed, 1), "completed": done,
            "failed": failed, "streamed_req_per_s": round(done / elapsed, 1),
            "gateway_cpu_ms_per_req": gateway_ms, "cpu_ms_per_req": per_req,
            "cpu_util": {name: round((cpu1[name] - cpu0[name]) / elapsed, 2) for name in pids},
            "machine_busy_cores": round((busy1 - busy0) / elapsed, 2),
            "machine_cores": round((total1 - total0) / elapsed, 2),
            "gateway_one_core_req_per_s_estimate": round(1000 / gateway_ms) if gateway_ms else None,
            "loadavg_end": loadavg}


async def start_gateway(kafka: KafkaSettings, tmp: Path, name: str, *args: str, **extra: str):
    """(process, chat URL) of a gateway answering /health."""
    (port,) = free_ports(1)
    process = await spawn(kafka, tmp / f"{name}.log", "gateway", "--port", str(port), *args, **extra)
    async with httpx.AsyncClient() as http:
        for _ in range(600):
            try:
                if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    return process, f"http://127.0.0.1:{port}/v1/chat/completions"


async def keys_phase(kafka: KafkaSettings, tmp: Path, open_url: str, pids: dict, args) -> dict:
    """What API keys cost: a second gateway with a keys file (100 keys, every request with one of them)
    beside the open one, both in front of the same worker; `--keys-rounds` rounds, each a throughput run and
    `--ttft-requests` one-at-a-time TTFTs on both, in alternating order. Medians over the rounds."""
    from gateway.keys import KeyEntry, digest, new_key, write_keys

    keyed_dir = tmp / "keyed"
    made = [new_key() for _ in range(100)]
    write_keys(keyed_dir / "keys.json", [KeyEntry(id=i, sha256=digest(k), tenant=f"t{n}")
                                          for n, (i, k) in enumerate(made)])
    key = made[57][1]
    keyed, keyed_url = await start_gateway(kafka, tmp, "gateway-keyed", *args.gateway_args.split(),
                                           GATEWAY_DATA_DIR=str(keyed_dir))
    runs: dict[str, dict[str, list[float]]] = {name: {"rps": [], "cpu_ms": [], "ttft": []}
                                               for name in ("open", "keyed")}
    try:
        sides = {"open": (open_url, None, pids), "keyed": (keyed_url, key, dict(pids, gateway=keyed.pid))}
        async with httpx.AsyncClient(timeout=60) as http:
            for i in range(5):
                await gateway_ttft(http, keyed_url, i, key)
            for r in range(args.keys_rounds):
                for name in (("open", "keyed") if r % 2 == 0 else ("keyed", "open")):
                    url, api_key, side_pids = sides[name]
                    out = await throughput_phase(url, args.concurrency, args.duration_s, side_pids, "raw",
                                                 warmup_s=2.0, api_key=api_key)
                    runs[name]["rps"].append(out["streamed_req_per_s"])
                    runs[name]["cpu_ms"].append(out["gateway_cpu_ms_per_req"])
            # TTFT one request at a time, the two gateways in turn, so that drift hits both alike.
            for j in range(args.ttft_requests):
                for name in (("open", "keyed") if j % 2 == 0 else ("keyed", "open")):
                    url, api_key, _ = sides[name]
                    runs[name]["ttft"].append(await gateway_ttft(http, url, j, api_key) * 1000)
    finally:
        keyed.send_signal(signal.SIGTERM)
        await keyed.wait()
    med = {name: {k: statistics.median(v) for k, v in run.items()} for name, run in runs.items()}
    return {"rounds": args.keys_rounds, "ttft_pairs": args.ttft_requests,
            "per_round": {name: {k: v for k, v in run.items() if k != "ttft"} for name, run in runs.items()},
            "open_req_per_s": round(med["open"]["rps"], 1), "keyed_req_per_s": round(med["keyed"]["rps"], 1),
            "keyed_over_open_req_per_s": round(med["keyed"]["rps"] / med["open"]["rps"], 3),
            "open_gateway_cpu_ms_per_req": med["open"]["cpu_ms"],
            "keyed_gateway_cpu_ms_per_req": med["keyed"]["cpu_ms"],
            "open_ttft_p50_ms": round(med["open"]["ttft"], 2), "keyed_ttft_p50_ms": round(med["keyed"]["ttft"], 2),
            "ttft_p50_added_ms": round(med["keyed"]["ttft"] - med["open"]["ttft"], 2)}


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


MIB = 1 << 20
UPLOAD_BOUNDARY = "bench-upload-boundary"


async def timed_stream(port: int, payload: bytes) -> list[float]:
    """One streamed answer over a fresh connection: the arrival time of each HTTP chunk (one event each)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                     f"\r\ncontent-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        if head[9:12] != b"200":
            raise RuntimeError(f"status {head[9:12].decode()}")
        arrivals = []
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0], 16)
            if size == 0:
                break
            await reader.readexactly(size + 2)
            arrivals.append(time.monotonic())
        return arrivals
    finally:
        writer.close()


def gap_stats(gaps: list[float]) -> dict:
    if not gaps:
        return {"gaps": 0}
    ordered = sorted(gaps)
    return {"gaps": len(gaps), "gap_p50_ms": round(statistics.median(ordered) * 1000, 2),
            "gap_p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
            "gap_max_ms": round(ordered[-1] * 1000, 2)}


async def stream_gaps(port: int, streams: int, max_tokens: int) -> list[tuple[float, float]]:
    """(gap, time it ended) between consecutive chunks of `streams` concurrent streamed answers."""
    answers = await asyncio.gather(*[timed_stream(port, json.dumps(body(i, max_tokens)).encode())
                                     for i in range(streams)])
    return [(b - a, b) for arrivals in answers for a, b in zip(arrivals, arrivals[1:])]


class Upload(threading.Thread):
    """A multipart upload of `total` file bytes with Transfer-Encoding: chunked, sent from a thread with
    blocking sends (so the benchmark's event loop, which times the streams, does not carry it), the answer
    read by a second thread meanwhile."""

    def __init__(self, port: int, total: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.port, self.total, self.limit = port, total, limit
        self.sent = 0
        self.started_at = self.crossed_at = self.answered_at = None
        self.status = None
        self.answer = b""
        self.underway = threading.Event()

    def _read(self, sock: socket.socket) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                piece = sock.recv(65536)
                if not piece:
                    return
                data += piece
        except OSError:
            return
        self.answered_at = time.monotonic()
        self.status = int(data[9:12])
        head, self.answer = data.split(b"\r\n\r\n", 1)
        marker = b"content-length:"
        if marker in head.lower():
            start = head.lower().index(marker) + len(marker)
            length = int(head[start:].split(b"\r\n", 1)[0])
            try:
                while len(self.answer) < length and (piece := sock.recv(65536)):
                    self.answer += piece
            except OSError:
                pass

    def run(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        reader = threading.Thread(target=self._read, args=(sock,), daemon=True)
        reader.start()
        block = (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 14_000)[:MIB]
        framed = f"{len(block):x}\r\n".encode() + block + b"\r\n"
        preamble = (f"--{UPLOAD_BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                    f"--{UPLOAD_BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
                    "\r\n").encode()
        self.started_at = time.monotonic()
        try:
            sock.sendall(f"POST /v1/files HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n"
                         f"content-type: multipart/form-data; boundary={UPLOAD_BOUNDARY}\r\n\r\n".encode()
                         + f"{len(preamble):x}\r\n".encode() + preamble + b"\r\n")
            while self.sent < self.total and self.answered_at is None:
                sock.sendall(framed)
                self.sent += len(block)
                if self.crossed_at is None and self.sent > self.limit:
                    self.crossed_at = time.monotonic()
                if self.sent >= 4 * MIB:
                    self.underway.set()
            if self.answered_at is None:
                end = f"\r\n--{UPLOAD_BOUNDARY}--\r\n".encode()
                sock.sendall(f"{len(end):x}\r\n".encode() + end + b"\r\n0\r\n\r\n")
        except OSError:
            pass  # refused and closed while the body was still going out
        finally:
            self.underway.set()
            reader.join(30)
            sock.close()


async def upload_phase(bootstrap: str, tmp: Path, streams: int, max_tokens: int, step_ms: float, upload_mib: int,
                       limit_mib: int) -> dict:
    """Streams alone, then streams while a large chunked upload goes in: inter-chunk gaps, and the 413."""
    kafka = settings(bootstrap)
    await ensure_topics(kafka)
    worker = await spawn(kafka, tmp / "upload-worker.log", "serve", "--engine", "instant", "--instant-step-ms",
                         str(step_ms))
    (port,) = free_ports(1)
    gateway = await spawn(kafka, tmp / "upload-gateway.log", "gateway", "--port", str(port),
                          GATEWAY_MAX_UPLOAD_BYTES=str(limit_mib * MIB), GATEWAY_DATA_DIR=str(tmp / "upload-data"))
    try:
        await wait_healthy(port)
        await stream_gaps(port, 4, 4)  # warm
        alone = await stream_gaps(port, streams, max_tokens)
        upload = Upload(port, upload_mib * MIB, limit_mib * MIB)
        upload.start()
        await asyncio.to_thread(upload.underway.wait, 60)
        during = await stream_gaps(port, streams, max_tokens)
        await asyncio.to_thread(upload.join, 120)
        end = upload.answered_at or time.monotonic()
        overlapping = [gap for gap, ended in during if ended <= end]
        alone_stats, during_stats = gap_stats([g for g, _ in alone]), gap_stats(overlapping)
        received_s = (end - upload.started_at) if upload.started_at else None
        return {
            "streams": streams, "max_tokens": max_tokens, "engine_step_ms": step_ms,
            "alone": alone_stats, "during_upload": during_stats,
            "whole_run_with_upload": gap_stats([g for g, _ in during]),
            "gap_p50_ratio": round(during_stats["gap_p50_ms"] / alone_stats["gap_p50_ms"], 3)
            if during_stats.get("gaps") and alone_stats.get("gaps") else None,
            "upload": {"mib": upload_mib, "limit_mib": limit_mib, "status": upload.status,
                       "answer": upload.answer.decode(errors="replace"), "mib_sent": round(upload.sent / MIB, 1),
                       "seconds_to_answer": round(received_s, 2) if received_s else None,
                       "refused_after_limit_ms": round((upload.answered_at - upload.crossed_at) * 1000, 1)
                       if upload.answered_at and upload.crossed_at else None}}
    finally:
        for process in (gateway, worker):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()


async def wait_healthy(port: int) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(600):
            try:
                if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"no gateway on port {port}")


async def main(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    target = start_broker(tmp)
    bootstrap, broker = target.bootstrap, target.broker
    worker = gateway = None
    phases = set(args.phases.split(","))
    try:
        result = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count()}
        if phases & {"ttft", "throughput", "batch", "keys"}:
            kafka = settings(bootstrap)
            await ensure_topics(kafka)
            worker = await spawn(kafka, tmp / "worker.log", "serve", "--engine", "instant")
            (port,) = free_ports(1)
            gateway = await spawn(kafka, tmp / "gateway.log", "gateway", "--port", str(port),
                                  *args.gateway_args.split())
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await wait_healthy(port)
        if "ttft" in phases:
            result["ttft"] = await ttft_phase(kafka, url, args.ttft_requests)
        if "throughput" in phases:
            pids = {"gateway": gateway.pid, "worker": worker.pid, "broker": broker.status().pid}
            result["throughput"] = await throughput_phase(url, args.concurrency, args.duration_s, pids,
                                                          args.client, py_spy=args.py_spy)
        if "keys" in phases:
            pids = {"gateway": gateway.pid, "worker": worker.pid, "broker": broker.status().pid}
            result["keys"] = await keys_phase(kafka, tmp, url, pids, args)
        if "batch" in phases:
            result["batch"] = await batch_phase(kafka, tmp, args.batch_lines)
        if "upload" in phases:
            result["upload"] = await upload_phase(bootstrap, tmp, args.upload_streams, args.upload_max_tokens,
                                                  args.upload_step_ms, args.upload_mib, args.upload_limit_mib)
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
    parser.add_argument("--phases", default="ttft,throughput,batch",
                        help="which phases, comma-separated (ttft, throughput, batch, keys, upload)")
    parser.add_argument("--keys-rounds", type=int, default=3, help="keys phase: rounds of open vs keyed")
    parser.add_argument("--upload-streams", type=int, default=100, help="upload phase: concurrent streams")
    parser.add_argument("--upload-max-tokens", type=int, default=150, help="upload phase: tokens per stream")
    parser.add_argument("--upload-step-ms", type=float, default=20.0,
                        help="upload phase: the instant engine's step (one token per stream per step)")
    parser.add_argument("--upload-mib", type=int, default=1024, help="upload phase: the chunked upload's size")
    parser.add_argument("--upload-limit-mib", type=int, default=960,
                        help="upload phase: the gateway's GATEWAY_MAX_UPLOAD_BYTES, in MiB")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="the throughput phase's load generator: a lean asyncio HTTP/1.1 client, or httpx")
    parser.add_argument("--gateway-args", default="", help="more arguments of `llm-worker gateway` (--loop, --http)")
    parser.add_argument("--py-spy", type=Path, default=None,
                        help="record the gateway and the worker with py-spy (raw stacks) into this folder")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "gateway.json")
    cli = parser.parse_args()
    outcome = asyncio.run(main(cli))
    print(json.dumps(outcome, indent=2))
    cli.json.parent.mkdir(parents=True, exist_ok=True)
    cli.json.write_text(json.dumps(outcome, indent=2))
