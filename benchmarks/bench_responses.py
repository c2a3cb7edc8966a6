"""Background responses at a rate: every one retrievable, each ending once, and a webhook endpoint that is down for
a while getting every event afterwards.

A local broker, one `llm-worker serve --engine instant` and one `llm-worker gateway` (each a process of its own),
and in this process a load generator (lean asyncio HTTP/1.1 keep-alive connections) and the webhook receiver
(a raw asyncio HTTP server that verifies every event's signature with the `openai` SDK).

1. Floor: `--n` `POST /v1/responses` with `background: true` at `--rate` a second (paced, on `--connections`
   connections); then every id polled with `GET /v1/responses/{id}` until it has ended. Reported: the rate
   reached, the POST latencies, how many were queued, retrievable and ended (by status), the time until the
   last ended and until the last webhook event came, the responses with no event or more than one, and the
   CPU milliseconds per response of each process (the bench process is the load generator and the receiver).
2. Endpoint down: the receiver closes its port, `--down-n` background responses are made and end, the port
   stays closed for `--down-s` seconds in all, then opens; every event must come (none twice), and the time
   from the port opening to the last event is reported.

    python -m benchmarks.bench_responses --n 2000 --rate 500 --down-s 20     # about a minute here
    python -m benchmarks.bench_responses --n 10000 --rate 1000 --down-s 120  # the floor, on a quiet machine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import openai

from benchmarks.bench_gateway import cpu_s, settings, spawn, wait_healthy
from benchmarks.lib.broker_target import start_broker
from gateway.webhooks import new_secret
from worker.broker.local import free_ports
from worker.broker.topics import ensure_topics

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TERMINAL = {"completed", "failed", "cancelled", "incomplete"}


class Connection:
    """One keep-alive HTTP/1.1 connection to the gateway: a request, and its status and JSON body."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def request(self, method: str, path: str, payload: bytes = b"") -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\n\r\n").encode()
        self.writer.write(head + payload)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lower = raw.lower()
        start = lower.index(b"content-length:") + 15
        body = await self.reader.readexactly(int(lower[start:lower.index(b"\r\n", start)]))
        if b"connection: close" in lower:
            self.writer.close()
            self.reader = self.writer = None
        return int(raw[9:12]), json.loads(body)


class Receiver:
    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.sdk = openai.OpenAI(api_key="-", base_url="http://127.0.0.1:1")
        self.events: Counter = Counter()
        self.types: Counter = Counter()
        self.num_bad = 0
        self.last_at = 0.0
        self.port = 0
        self.server = None

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, backlog=1024)
        self.port = self.server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        try:
            await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            try:
                event = self.sdk.webhooks.unwrap(body, headers, secret=self.secret)
                self.events[event.data.id] += 1
                self.types[event.type] += 1
                self.last_at = time.monotonic()
                status = b"200 OK"
            except openai.InvalidWebhookSignatureError:
                self.num_bad += 1
                status = b"400 Bad Request"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


async def submit(port: int, n: int, rate: float, connections: int, tag: str) -> dict:
    ids: list[str | None] = [None] * n
    statuses: Counter = Counter()
    latencies: list[float] = []
    counter = iter(range(n))
    started = time.monotonic()

    async def worker() -> None:
        connection = Connection(port)
        for i in counter:
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            payload = json.dumps({"model": MODEL, "input": f"{tag} question {i}", "background": True,
                                  "max_output_tokens": 4}).encode()
            sent = time.monotonic()
            status, body = await connection.request("POST", "/v1/responses", payload)
            latencies.append(time.monotonic() - sent)
            if status == 200:
                ids[i] = body["id"]
                statuses[body["status"]] += 1
            else:
                statuses[f"http {status}"] += 1

    await asyncio.gather(*[worker() for _ in range(connections)])
    elapsed = time.monotonic() - started
    return {"ids": [i for i in ids if i], "submitted": n, "seconds": round(elapsed, 2),
            "rate_reached": round(n / elapsed, 1), "answers": dict(statuses),
            "post_ms_p50": round(1000 * statistics.median(latencies), 2),
            "post_ms_p99": round(1000 * percentile(latencies, 0.99), 2)}


async def poll_all(port: int, ids: list[str], connections: int, timeout_s: float) -> dict:
    pending = list(ids)
    ended: dict[str, str] = {}
    missing: Counter = Counter()
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        queue = iter(pending)
        still: list[str] = []

        async def worker() -> None:
            connection = Connection(port)
            for response_id in queue:
                status, body = await connection.request("GET", f"/v1/responses/{response_id}")
                if status != 200:
                    missing[status] += 1
                    still.append(response_id)
                elif body["status"] in TERMINAL:
                    ended[response_id] = body["status"]
                else:
                    still.append(response_id)

        await asyncio.gather(*[worker() for _ in range(connections)])
        pending = still
        if pending:
            await asyncio.sleep(0.5)
    return {"ended": dict(Counter(ended.values())), "not_ended": len(pending), "not_retrievable": dict(missing)}


async def wait_events(receiver: Receiver, ids: list[str], timeout_s: float) -> float | None:
    started = time.monotonic()
    wanted = set(ids)
    while time.monotonic() - started < timeout_s:
        if all(receiver.events[i] for i in wanted):
            return time.monotonic()
        await asyncio.sleep(0.1)
    return None


def event_counts(receiver: Receiver, ids: list[str]) -> dict:
    counts = Counter(receiver.events[i] for i in ids)
    return {"with_one_event": counts[1], "with_none": counts[0],
            "with_more": sum(v for k, v in counts.items() if k > 1), "bad_signatures": receiver.num_bad}


async def main(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-responses-"))
    target = start_broker(tmp)
    secret = new_secret()
    receiver = Receiver(secret)
    await receiver.up()
    worker = gateway = None
    try:
        kafka = settings(target.bootstrap)
        await ensure_topics(kafka)
        worker = await spawn(kafka, tmp / "worker.log", "serve", "--engine", "instant")
        (port,) = free_ports(1)
        gateway = await spawn(
            kafka, tmp / "gateway.log", "gateway", "--port", str(port),
            GATEWAY_DATA_DIR=str(tmp / "gateway"), GATEWAY_RESPONSES_TOPIC=f"bench.responses.{os.getpid()}",
            GATEWAY_WEBHOOK_URLS=json.dumps([f"http://127.0.0.1:{receiver.port}/hooks"]),
            GATEWAY_WEBHOOK_SECRET=secret, GATEWAY_WEBHOOK_ALLOWED_HOSTS='["127.0.0.1"]',
            GATEWAY_WEBHOOK_BACKOFF_INITIAL_S="0.5", GATEWAY_WEBHOOK_BACKOFF_MAX_S=str(args.backoff_max_s),
            GATEWAY_WEBHOOK_RETRY_S=str(max(600.0, 4 * args.down_s)))
        await wait_healthy(port)
        result: dict = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count(),
                        "n": args.n, "rate": args.rate}

        pids = {"gateway": gateway.pid, "worker": worker.pid, "broker": target.broker.status().pid,
                "bench": os.getpid()}
        cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        floor = await submit(port, args.n, args.rate, args.connections, "floor")
        ids = floor.pop("ids")
        floor.update(await poll_all(port, ids, args.connections, args.timeout_s))
        floor["seconds_to_all_ended"] = round(time.monotonic() - started, 2)
        last = await wait_events(receiver, ids, args.timeout_s)
        floor["seconds_to_all_events"] = round(last - started, 2) if last else None
        # CPU per response until every event came: its POST, run, polls (once it is ended, one each), event.
        floor["cpu_ms_per_response"] = {name: round(1000 * (cpu_s(pid) - cpu_before[name]) / max(1, len(ids)), 3)
                                        for name, pid in pids.items()}
        await asyncio.sleep(2.0)  # a duplicate would come now
        floor.update(event_counts(receiver, ids))
        result["floor"] = floor

        await receiver.down()
        down_at = time.monotonic()
        down = await submit(port, args.down_n, min(args.rate, 500.0), args.connections, "down")
        down_ids = down.pop("ids")
        down.update(await poll_all(port, down_ids, args.connections, args.timeout_s))
        await asyncio.sleep(max(0.0, down_at + args.down_s - time.monotonic()))
        await receiver.up()
        up_at = time.monotonic()
        down["seconds_down"] = round(up_at - down_at, 1)
        last = await wait_events(receiver, down_ids, args.timeout_s)
        down["seconds_from_up_to_all_events"] = round(last - up_at, 2) if last else None
        await asyncio.sleep(2.0)
        down.update(event_counts(receiver, down_ids))
        result["endpoint_down"] = down
        result["event_types"] = dict(receiver.types)
        result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
        return result
    finally:
        for process in (gateway, worker):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), 30)
        target.broker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="background responses of the floor phase")
    parser.add_argument("--rate", type=float, default=1000.0, help="POSTs a second")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--down-n", type=int, default=500, help="responses made while the endpoint is down")
    parser.add_argument("--down-s", type=float, default=120.0, help="how long the endpoint stays down")
    parser.add_argument("--backoff-max-s", type=float, default=5.0, help="GATEWAY_WEBHOOK_BACKOFF_MAX_S")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "responses.json")
    cli = parser.parse_args()
    outcome = asyncio.run(main(cli))
    print(json.dumps(outcome, indent=2))
    cli.json.parent.mkdir(parents=True, exist_ok=True)
    cli.json.write_text(json.dumps(outcome, indent=2))
