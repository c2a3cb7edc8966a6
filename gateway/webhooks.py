"""Webhooks: signed events (response.completed, batch.failed, ...) POSTed to configured endpoints.

The shape is OpenAI's (`{"id", "object": "event", "type", "created_at", "data": {"id"}}`), signed per Standard
Webhooks: `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">` with the base64-decoded `whsec_` secret, so the official SDKs'
`client.webhooks.unwrap` verifies them. Each attempt is signed afresh (receivers refuse old timestamps).

Delivery never blocks generation: an event is one small file under `GATEWAY_DATA_DIR/webhooks/pending`
(written in a thread), and a delivery loop of its own sends it, at most `webhook_concurrency` at once. A failed
attempt waits `webhook_backoff_initial_s`, doubling up to `webhook_backoff_max_s`; an event still undelivered
`webhook_retry_s` after it was made is dropped, logged and counted. A restart reloads the pending files, so
neither a restart nor an endpoint down for a while loses an event within that bound. A delivery that succeeds
brings the other events of its URL forward: an endpoint that comes back gets its backlog at once, not at each
event's next backoff.

An event id is chosen by its producer (one per response's or batch's end), and a file is kept for it once
delivered (`sent/`, for as long as an event may still be retried), so an end recorded twice (a restart between
queueing the event and publishing the state) is still delivered once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import heapq
import hmac
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.files import write_json
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

EVENT_TYPES = ("response.completed", "response.failed", "response.cancelled", "response.incomplete",
               "batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
SENT_SWEEP_S = 3600.0


def configuration_error(settings: GatewaySettings) -> str | None:
    """Why the webhook settings cannot be used (one line naming the setting), or None."""
    if not settings.webhook_urls:
        return None
    secret = settings.webhook_secret
    if not secret.startswith("whsec_"):
        return "GATEWAY_WEBHOOK_SECRET must be a signing secret whsec_<base64> when GATEWAY_WEBHOOK_URLS is set"
    try:
        if not base64.b64decode(secret[6:], validate=True):
            raise ValueError
    except ValueError:
        return "GATEWAY_WEBHOOK_SECRET is not whsec_ followed by base64"
    allowed = {h.lower() for h in settings.webhook_allowed_hosts}
    for url in settings.webhook_urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"GATEWAY_WEBHOOK_URLS: {url!r} is not an http(s) URL"
        if parts.hostname.lower() not in allowed:
            return (f"GATEWAY_WEBHOOK_URLS: the host of {url!r} is not in GATEWAY_WEBHOOK_ALLOWED_HOSTS "
                    f"({', '.join(sorted(allowed)) or 'empty'})")
    return None


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter("llm_gateway_webhook_attempts", "Webhook delivery attempts by event type and outcome "
                                "(delivered, failed).", ["type", "outcome"], registry=registry)
        self.dropped = Counter("llm_gateway_webhook_dropped", "Webhook events dropped undelivered after "
                               "GATEWAY_WEBHOOK_RETRY_S.", ["type"], registry=registry)
        self.pending = Gauge("llm_gateway_webhook_pending", "Webhook events waiting for delivery.",
                             registry=registry)


@dataclass(order=True, slots=True)
class _Due:
    at: float
    name: str = field(compare=False)


class Webhooks:
    def __init__(self, settings: GatewaySettings, root: Path, registry: CollectorRegistry,
                 clock=time.time) -> None:
        self.settings = settings
        self.urls = list(settings.webhook_urls)
        self.pending_dir = Path(root) / "webhooks" / "pending"
        self.sent_dir = Path(root) / "webhooks" / "sent"
        self.metrics = WebhookMetrics(registry)
        self.clock = clock
        self._events: dict[str, dict] = {}
        """Pending deliveries by file name (event id and URL index): the event and when to try next."""
        self._due: list[_Due] = []
        self._wake = asyncio.Event()
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="webhooks")
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()
        self._failing: set[str] = set()
        """URLs whose last attempt failed: the first success brings their waiting events forward."""
        self.num_delivered = 0
        self.num_failed_attempts = 0
        self.num_dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.urls)

    # -- queueing ---------------------------------------------------------------------------------------
    def _write(self, names: list[str], data: list[bytes]) -> list[str]:
        written = []
        for name, value in zip(names, data):
            if (self.pending_dir / name).exists() or (self.sent_dir / name).exists():
                continue  # this event was queued (or delivered) already
            write_json(self.pending_dir / name, value)
            written.append(name)
        return written

    async def emit(self, event_id: str, kind: str, object_id: str, created_at: int | None = None) -> None:
        """Queues one event for every URL: on disk when this returns, delivered from then on."""
        if not self.enabled:
            return
        assert kind in EVENT_TYPES, kind
        now = self.clock()
        event = {"id": event_id, "object": "event", "type": kind,
                 "created_at": int(created_at if created_at is not None else now), "data": {"id": object_id}}
        body = msgspec.json.encode(event)
        names, data = [], []
        for index, url in enumerate(self.urls):
            names.append(f"{event_id}.{index}.json")
            data.append(msgspec.json.encode({"url": url, "type": kind, "first_at": now, "body": body.decode()}))
        written = await asyncio.get_running_loop().run_in_executor(self._disk, self._write, names, data)
        for name, value in zip(names, data):
            if name in written:
                self._schedule(name, msgspec.json.decode(value), now)

    def _schedule(self, name: str, entry: dict, at: float) -> None:
        entry.setdefault("attempts", 0)
        self._events[name] = entry
        heapq.heappush(self._due, _Due(at, name))
        self.metrics.pending.set(len(self._events))
        self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------------------
    def _load(self) -> list[tuple[str, dict]]:
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        self.sent_dir.mkdir(parents=True, exist_ok=True)
        loaded = []
        for path in sorted(self.pending_dir.glob("*.json")):
            try:
                loaded.append((path.name, msgspec.json.decode(path.read_bytes())))
            except (OSError, msgspec.DecodeError):
                log.warning("%s: an unreadable webhook event is skipped", path)
        return loaded

    async def start(self) -> None:
        loaded = await asyncio.get_running_loop().run_in_executor(self._disk, self._load)
        now = self.clock()
        for name, entry in loaded:
            if entry.get("url") in self.urls:
                self._schedule(name, entry, now)
            else:
                log.warning("webhook event %s is for %s, no longer configured: dropped", name, entry.get("url"))
                self._discard(name)
        if loaded:
            log.info("%d webhook events waiting from before the start", len(loaded))
        self._tasks = [asyncio.create_task(self._deliver_loop(), name="webhooks"),
                       asyncio.create_task(self._sweep_sent(), name="webhooks-sweep")]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._sending]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._sending, return_exceptions=True)
        await asyncio.to_thread(self._disk.shutdown)

    @property
    def num_pending(self) -> int:
        return len(self._events)

    async def drained(self, timeout_s: float) -> bool:
        """True once no event waits (tests and the benchmark)."""
        deadline = time.monotonic() + timeout_s
        while self._events:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # -- delivering -------------------------------------------------------------------------------------
    async def _deliver_loop(self) -> None:
        limit = asyncio.Semaphore(self.settings.webhook_concurrency)
        while True:
            self._wake.clear()
            now = self.clock()
            while self._due and self._due[0].at <= now:
                due = heapq.heappop(self._due)
                entry = self._events.get(due.name)
                if entry is None or entry.get("busy"):
                    continue
                await limit.acquire()
                entry["busy"] = True
                task = asyncio.create_task(self._attempt(due.name, entry))
                self._sending.add(task)
                task.add_done_callback(lambda t: (self._sending.discard(t), limit.release()))
                now = self.clock()
            wait_s = self._due[0].at - self.clock() if self._due else 3600.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait_s)):
                    await self._wake.wait()

    async def _attempt(self, name: str, entry: dict) -> None:
        body = entry["body"].encode()
        event_id = name.rsplit(".", 2)[0]
        try:
            status = await post(entry["url"], body, self._headers(event_id, body), self.settings.webhook_timeout_s)
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except (OSError, TimeoutError, ValueError) as exc:
            error = repr(exc)
        entry["busy"] = False
        if error is None:
            self.metrics.attempts.labels(entry["type"], "delivered").inc()
            self.num_delivered += 1
            # On disk first: an event that has left `_events` is settled there too (drained() reads that).
            await asyncio.get_running_loop().run_in_executor(self._disk, self._mark_sent, name)
            self._events.pop(name, None)
            self.metrics.pending.set(len(self._events))
            if entry["url"] in self._failing:
                self._failing.discard(entry["url"])
                log.info("webhook endpoint %s answers again; %d events waiting", entry["url"], len(self._events))
                self._bring_forward(entry["url"])
            return
        self.metrics.attempts.labels(entry["type"], "failed").inc()
        self.num_failed_attempts += 1
        entry["attempts"] += 1
        now = self.clock()
        if now - entry["first_at"] > self.settings.webhook_retry_s:
            self.metrics.dropped.labels(entry["type"]).inc()
            self.num_dropped += 1
            log.warning("webhook event %s (%s) to %s dropped after %d attempts over %.0f s (GATEWAY_WEBHOOK_RETRY_S): "
                        "%s", event_id, entry["type"], entry["url"], entry["attempts"], now - entry["first_at"],
                        error)
            await asyncio.get_running_loop().run_in_executor(self._disk, self._discard, name)
            self._events.pop(name, None)
            self.metrics.pending.set(len(self._events))
            return
        if entry["url"] not in self._failing:  # a line when an endpoint starts failing, not one per event
            self._failing.add(entry["url"])
            log.warning("webhook event %s to %s failed (%s); its events are retried with backoff for up to %.0f s "
                        "(GATEWAY_WEBHOOK_RETRY_S)", event_id, entry["url"], error, self.settings.webhook_retry_s)
        backoff = min(self.settings.webhook_backoff_max_s,
                      self.settings.webhook_backoff_initial_s * 2 ** (entry["attempts"] - 1))
        heapq.heappush(self._due, _Due(now + backoff * random.uniform(0.8, 1.0), name))
        self._wake.set()

    def _bring_forward(self, url: str) -> None:
        now = self.clock()
        moved = False
        for due in self._due:
            entry = self._events.get(due.name)
            if entry is not None and entry["url"] == url and entry["attempts"] and due.at > now:
                due.at = now
                moved = True
        if moved:
            heapq.heapify(self._due)
            self._wake.set()

    def _headers(self, event_id: str, body: bytes) -> dict[str, str]:
        timestamp = int(self.clock())
        return {"content-type": "application/json", "webhook-id": event_id, "webhook-timestamp": str(timestamp),
                "webhook-signature": sign(self.settings.webhook_secret, event_id, timestamp, body),
                "user-agent": "llm-worker-gateway"}

    def _mark_sent(self, name: str) -> None:
        (self.sent_dir / name).touch()
        with contextlib.suppress(FileNotFoundError):
            (self.pending_dir / name).unlink()

    def _discard(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.pending_dir / name).unlink()

    async def _sweep_sent(self) -> None:
        """Delivered markers are kept as long as an event could be queued again, then removed."""
        while True:
            await asyncio.sleep(SENT_SWEEP_S)
            cutoff = self.clock() - self.settings.webhook_retry_s - SENT_SWEEP_S

            def sweep() -> None:
                for path in self.sent_dir.iterdir():
                    with contextlib.suppress(FileNotFoundError):
                        if path.stat().st_mtime < cutoff:
                            path.unlink()

            await asyncio.get_running_loop().run_in_executor(self._disk, sweep)


async def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POSTs `body` over HTTP/1.1 (TLS for https) and returns the status code. One connection per event: events
    are few next to requests, and a fresh connection needs no pool to recover from an endpoint's restart."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    lines = [f"POST {target} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}", "connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=True if tls else None)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line = await reader.readline()
            fields = status_line.split()
            if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
                raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
            return int(fields[1])
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()
