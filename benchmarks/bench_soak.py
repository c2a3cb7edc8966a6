"""Soak benchmark: steady traffic through the real broker to one `llm-worker serve` for N minutes, sampling the
worker's memory; does it stay flat, and does the worker serve as fast at the end as at minute 5?

A LocalBroker on free ports, fresh topics, one worker subprocess (the default model on the CPU unless told
otherwise; lag shedding off, so every request is served), and an open-loop librdkafka producer at `--rate`
requests/s. Kinds of traffic (`--kind`, or `mix` for all of them by MIX_WEIGHTS):

    plain     a short greedy prompt, unique id and metadata
    schema    json_schema output with a schema of its own (every request a distinct grammar)
    n2        n = 2 completions, sampled with a seed
    logprobs  logprobs with 3 top alternatives
    stop      two stop strings, one distinct per request
    cancel    a request cancelled ~0.3 s after it was sent (in the queue, the engine, or already answered)

Besides requests, `--unknown-cancels` (0.1) cancel records of ids no request has are sent per request. Midway
(`--rebalance`), a second consumer joins the group for `--rebalance-hold-s`: the worker gives up half its
partitions, their requests wait, and come back to it when that consumer leaves. `--rebalances N` does that N
times, evenly spaced, and reports what each left behind (`rebalance_steps`): does every burst add memory, or
only the first?

Every `--sample-s` the worker's resident size is read from /proc and its metrics endpoint is scraped for the
Python heap (allocated blocks), glibc's heap (in use, free) and each per-request table's entries
(worker/transport/memory_metrics.py). Growth per 1,000 requests after warm-up is the least-squares slope of
each against the finals received; it is also given before the rebalance and from 30 s after it, since the
requests it held back come back as one burst, a one-off rise to a larger batch's high-water mark. The floor:
RSS grows by no more than 1 MB per 10,000 requests (100 KB per 1,000) after warm-up, and the finals/s of the
last minute equals minute 5's.

Writes summary-<kind>.json and memory-<kind>.png under benchmarks/results/<date>-soak[-label]/ and the raw
samples under benchmarks/results/raw/<date>-soak[-label]/. The 30-minute run of the issue:

    .venv/bin/python -m benchmarks.bench_soak --minutes 30 --rate 8 --kind mix
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer

from schemas.control import CancelRecord
from schemas.decode import decode_result, decode_status, encode
from schemas.priority import partition_for
from schemas.request import (
    GenerationRequest,
    JsonSchemaFormat,
    JsonSchemaSpec,
    SamplingSpec,
)
from schemas.result import FinalRecord
from worker.broker.net import free_port
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings
from worker.memory import mappings, resident_bytes, resident_parts

REPO = Path(__file__).resolve().parents[1]
KINDS = ("plain", "schema", "n2", "logprobs", "stop", "cancel")
MIX_WEIGHTS = {"plain": 0.45, "schema": 0.20, "n2": 0.10, "logprobs": 0.10, "stop": 0.10, "cancel": 0.05}
FLOOR_KB_PER_1000 = 100.0
"""1 MB per 10,000 requests."""
NO_SHEDDING = "[1000000.0, 1000000.0, 1000000.0]"
"""WORKER_MAX_QUEUE_TIME_S: lag shedding off, so every request is served."""
TOPICS = ("cats", "rivers", "trains", "bread", "stars", "chess", "rain", "maps", "bees", "salt")


# ---- pure parts (tests/bench/test_soak.py) --------------------------------------------------------------


def kind_at(i: int, kind: str, seed: int = 0) -> str:
    """The kind of the i-th request: `kind` itself, or for `mix` a draw by MIX_WEIGHTS (reproducible)."""
    if kind != "mix":
        return kind
    return random.Random(seed * 1_000_003 + i).choices(list(MIX_WEIGHTS), weights=list(MIX_WEIGHTS.values()))[0]


def make_request(i: int, kind: str, max_new_tokens: int, run_id: str) -> GenerationRequest:
    """Request i of a run: a unique id and metadata; what else it asks depends on its kind."""
    fields: dict = dict(
        id=f"soak-{run_id}-{i}", prompt=f"Write one short sentence about {TOPICS[i % len(TOPICS)]} ({i}).",
        max_new_tokens=max_new_tokens, metadata={"client": f"c{i % 97}", "seq": str(i), "trace": uuid.uuid4().hex},
    )
    if kind == "schema":
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"},
                                                   "note": {"type": "string", "maxLength": 8}},
                  "required": [f"k{i}"]}
        fields["response_format"] = JsonSchemaFormat(json_schema=JsonSchemaSpec(schema=schema))
        fields["max_new_tokens"] = max(max_new_tokens, 24)
    elif kind == "n2":
        fields.update(n=2, sampling=SamplingSpec(temperature=0.7, seed=i))
    elif kind == "logprobs":
        fields["sampling"] = SamplingSpec(logprobs=True, top_logprobs=3)
    elif kind == "stop":
        fields["sampling"] = SamplingSpec(stop=[f"#{i}#", "\n\n"])
    return GenerationRequest(**fields)


def slope_per_1000(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs, times 1,000 (ys per 1,000 xs); None without two distinct xs."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def window_rate(times: list[float], start: float, end: float) -> float:
    """Events per second in [start, end)."""
    return sum(start <= t < end for t in times) / (end - start) if end > start else 0.0


@dataclass
class Sample:
    t: float
    """Seconds since the first request was sent."""
    num_sent: int
    num_finals: int
    rss_bytes: int | None
    rss_anon_bytes: int | None = None
    rss_file_bytes: int | None = None
    python_blocks: float | None = None
    native_in_use_bytes: float | None = None
    native_free_bytes: float | None = None
    tables: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str) -> dict:
    """The memory gauges of a Prometheus exposition (memory_metrics.py): plain values by name, tables by label."""
    out: dict = {"tables": {}}
    for line in text.splitlines():
        if not line.startswith("llm_worker:"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("llm_worker:table_entries{"):
            out["tables"][name.split('table="', 1)[1].split('"', 1)[0]] = float(value)
        elif name in ("llm_worker:python_allocated_blocks", "llm_worker:native_heap_in_use_bytes",
                      "llm_worker:native_heap_free_bytes", "llm_worker:resident_memory_bytes"):
            out[name.removeprefix("llm_worker:")] = float(value)
    return out


def growth(samples: list[Sample], warmup_s: float, end_s: float = float("inf")) -> dict:
    """Per 1,000 finals from warmup_s to end_s: RSS and glibc in-use in KB, Python blocks; and RSS at both ends
    (MB)."""
    after = [s for s in samples if warmup_s <= s.t < end_s and s.rss_bytes is not None]
    xs = [float(s.num_finals) for s in after]

    def slope(values: list[float | None], scale: float) -> float | None:
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
        result = slope_per_1000([p[0] for p in pairs], [p[1] / scale for p in pairs])
        return None if result is None else round(result, 2)

    return {
        "num_samples": len(after),
        "num_finals": int(xs[-1] - xs[0]) if xs else 0,
        "rss_kb_per_1000": slope([s.rss_bytes for s in after], 1024.0),
        "rss_anon_kb_per_1000": slope([s.rss_anon_bytes for s in after], 1024.0),
        "rss_file_kb_per_1000": slope([s.rss_file_bytes for s in after], 1024.0),
        "native_in_use_kb_per_1000": slope([s.native_in_use_bytes for s in after], 1024.0),
        "python_blocks_per_1000": slope([s.python_blocks for s in after], 1.0),
        "rss_mb_at_warmup": round(after[0].rss_bytes / 2**20, 1) if after else None,
        "rss_mb_at_end": round(after[-1].rss_bytes / 2**20, 1) if after else None,
    }


STEP_WINDOW_S = 60.0
BURST_SETTLE_S = 30.0
"""How long after the second member leaves the burst it handed back counts as served."""
HALF_HOUR_S = 1800.0
"""The window of the floor: growth is judged over 30-minute soaks."""


def rebalance_step(samples: list[Sample], rebalance: dict) -> dict:
    """What one rebalance left behind: the median of each gauge over the STEP_WINDOW_S after it (from
    BURST_SETTLE_S after the second member left, once the burst is served) less its median over the
    STEP_WINDOW_S before that member joined. RSS and glibc's in-use heap in KB, Python blocks."""
    joined, left = rebalance["joined_s"], rebalance["left_s"]
    before = [s for s in samples if joined - STEP_WINDOW_S <= s.t < joined]
    after = [s for s in samples if left + BURST_SETTLE_S <= s.t < left + BURST_SETTLE_S + STEP_WINDOW_S]

    def step(value, scale: float) -> float | None:
        a = [v for v in map(value, after) if v is not None]
        b = [v for v in map(value, before) if v is not None]
        return round((statistics.median(a) - statistics.median(b)) / scale, 1) if a and b else None

    return {"joined_s": joined, "left_s": left, "rss_kb": step(lambda s: s.rss_bytes, 1024.0),
            "native_in_use_kb": step(lambda s: s.native_in_use_bytes, 1024.0),
            "python_blocks": step(lambda s: s.python_blocks, 1.0)}


GLIBC_HEAP_ALIGN = 64 * 2**20
"""glibc maps each arena but the main one as a heap aligned to its 64 MiB maximum size (HEAP_MAX_SIZE); as the
heap grows and shrinks, its range splits into several mappings."""


def mapping_kinds(mappings: list) -> dict[int, str]:
    """Start address -> kind for a snapshot's mappings: "main heap" (glibc's main arena), "glibc's other
    arenas" (every anonymous mapping inside a 64 MiB range that one of them starts), "anonymous, other"
    (glibc's mmapped blocks, Python's and torch's own mappings, thread stacks), "file", or the kernel's name."""
    arenas = {start for start, _, _, name in mappings if name == "" and start % GLIBC_HEAP_ALIGN == 0}
    kinds = {}
    for start, _, _, name in mappings:
        if name == "":
            inside = start - start % GLIBC_HEAP_ALIGN in arenas
            kinds[start] = "glibc's other arenas" if inside else "anonymous, other"
        elif name == "[heap]":
            kinds[start] = "main heap"
        else:
            kinds[start] = "file" if name.startswith("/") else name
    return kinds


def mapping_growth(first: dict, last: dict, top: int = 8) -> dict:
    """What each kind of mapping gained in resident KB between two snapshots, and the `top` mappings that
    gained most (a mapping is matched by its start address; one new since the first counts from 0)."""
    before = {m[0]: m for m in first["mappings"]}
    kinds = {**mapping_kinds(first["mappings"]), **mapping_kinds(last["mappings"])}
    by_kind: dict[str, float] = {}
    changes = []
    for start, size, rss, name in last["mappings"]:
        gained = rss - (before.pop(start)[2] if start in before else 0)
        by_kind[kinds[start]] = by_kind.get(kinds[start], 0.0) + gained
        changes.append((gained, start, size, name))
    for start, _, rss, _ in before.values():  # gone since
        by_kind[kinds[start]] = by_kind.get(kinds[start], 0.0) - rss
    changes.sort(reverse=True)
    return {
        "from_s": first["t"], "to_s": last["t"], "finals": last["num_finals"] - first["num_finals"],
        "kb_by_kind": {kind: round(b / 1024, 1) for kind, b in sorted(by_kind.items())},
        "top": [{"start": hex(start), "size_kb": size // 1024, "gained_kb": round(g / 1024, 1), "name": name}
                for g, start, size, name in changes[:top] if g > 0],
    }


# ---- the run --------------------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, kafka: KafkaSettings, log_path: Path) -> None:
        self.args, self.kafka, self.log_path = args, kafka, log_path
        self.run_id = uuid.uuid4().hex[:6]
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.sent_at: dict[str, float] = {}
        self.final_times: list[float] = []
        self.latencies: list[tuple[float, float]] = []
        """(final's time, seconds from send to final) per request."""
        self.statuses: dict[str, int] = {}
        self.samples: list[Sample] = []
        self.snapshots: list[dict] = []
        """The worker's mappings every `--mappings-every-s`: {t, num_finals, mappings: [[start, size, rss, name]]}."""
        self.ready = asyncio.Event()
        self.t0 = 0.0
        self.num_sent = 0
        self.rebalances: list[dict] = []

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        k = self.kafka
        env.update({
            "KAFKA_BOOTSTRAP_SERVERS": k.bootstrap_servers, "KAFKA_REQUEST_TOPIC": k.request_topic,
            "KAFKA_RESULT_TOPIC": k.result_topic, "KAFKA_DEAD_LETTER_TOPIC": k.dead_letter_topic,
            "KAFKA_STATUS_TOPIC": k.status_topic, "KAFKA_CONTROL_TOPIC": k.control_topic,
            "KAFKA_GROUP_ID": k.group_id, "WORKER_METRICS_PORT": str(self.metrics_port),
            "WORKER_MAX_QUEUE_TIME_S": NO_SHEDDING, "WORKER_WORKER_ID": f"soak-{self.run_id}",
            "OMP_NUM_THREADS": str(self.args.threads), "MKL_NUM_THREADS": str(self.args.threads),
            "ENGINE_DEVICE": "cpu",
        })
        for item in self.args.worker_env:
            key, _, value = item.partition("=")
            env[key] = value
        return env

    def start_worker(self) -> None:
        cmd = [*shlex.split(self.args.worker_wrapper), str(REPO / ".venv/bin/llm-worker"), "serve",
               "--engine", self.args.engine]
        if self.args.engine == "instant":
            cmd += ["--instant-step-ms", str(self.args.instant_step_ms)]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=self.log, env=self.worker_env())

    async def read_loop(self) -> None:
        consumer = AIOKafkaConsumer(self.kafka.result_topic, self.kafka.status_topic, **self.kafka.client_kwargs(),
                                    group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
                now = time.monotonic()
                for tp, msgs in batches.items():
                    for msg in msgs:
                        if tp.topic == self.kafka.status_topic:
                            status = decode_status(msg.value)
                            if len(status.assigned_partitions) >= self.kafka.num_request_partitions:
                                self.ready.set()
                            continue
                        record = decode_result(msg.value)
                        if isinstance(record, FinalRecord) and record.index is None:
                            sent = self.sent_at.pop(record.id, None)
                            if sent is None:
                                continue  # a repeat (a redelivered attempt) or the warm-up
                            self.final_times.append(now - self.t0)
                            self.latencies.append((now - self.t0, now - sent))
                            self.statuses[record.status] = self.statuses.get(record.status, 0) + 1
        finally:
            await consumer.stop()

    async def sample_loop(self) -> None:
        next_snapshot = 0.0
        while True:
            now = time.monotonic() - self.t0
            if self.args.mappings_every_s and now >= next_snapshot:
                next_snapshot = now + self.args.mappings_every_s
                taken = await asyncio.to_thread(mappings, self.proc.pid)
                if taken is not None:
                    self.snapshots.append({"t": round(now, 2), "num_finals": len(self.final_times),
                                           "mappings": [list(m) for m in taken]})
            metrics = {"tables": {}}
            try:
                text = await asyncio.to_thread(self._scrape)
                metrics = parse_metrics(text)
            except OSError:
                pass
            parts = resident_parts(self.proc.pid) or {}
            self.samples.append(Sample(
                t=round(time.monotonic() - self.t0, 2), num_sent=self.num_sent, num_finals=len(self.final_times),
                rss_bytes=resident_bytes(self.proc.pid), rss_anon_bytes=parts.get("anon"),
                rss_file_bytes=parts.get("file"), python_blocks=metrics.get("python_allocated_blocks"),
                native_in_use_bytes=metrics.get("native_heap_in_use_bytes"),
                native_free_bytes=metrics.get("native_heap_free_bytes"), tables=metrics["tables"]))
            await asyncio.sleep(self.args.sample_s)

    def _scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    async def send_loop(self, producer, duration_s: float) -> None:
        """Open loop: request i goes at t0 + i / rate, whatever the worker does."""
        args = self.args
        cancels: list[tuple[float, str]] = []
        rng = random.Random(args.seed)
        i = 0
        while True:
            due = self.t0 + i / args.rate
            now = time.monotonic()
            if due - self.t0 >= duration_s:
                break
            while cancels and cancels[0][0] <= now:
                self._produce(producer, self.kafka.control_topic, None, encode(CancelRecord(id=cancels.pop(0)[1])))
            if due > now:
                producer.poll(0)
                await asyncio.sleep(min(due - now, 0.05))
                continue
            kind = kind_at(i, args.kind, args.seed)
            request = make_request(i, kind, args.max_new_tokens, self.run_id)
            partition = partition_for(1, request.id, self.kafka.num_request_partitions, self.kafka.num_priorities)
            self.sent_at[request.id] = time.monotonic()
            self._produce(producer, self.kafka.request_topic, request.id.encode(), encode(request), partition)
            if kind == "cancel":
                cancels.append((now + 0.3, request.id))
            if rng.random() < args.unknown_cancels:
                self._produce(producer, self.kafka.control_topic, None,
                              encode(CancelRecord(id=f"unknown-{uuid.uuid4().hex}", reason="soak")))
            self.num_sent = i = i + 1
        for _, request_id in cancels:
            self._produce(producer, self.kafka.control_topic, None, encode(CancelRecord(id=request_id)))
        producer.flush(30)

    @staticmethod
    def _produce(producer, topic: str, key: bytes | None, value: bytes, partition: int | None = None) -> None:
        kwargs = {} if partition is None else {"partition": partition}
        while True:
            try:
                producer.produce(topic, value=value, key=key, **kwargs)
                return
            except BufferError:
                producer.poll(0.1)

    async def rebalance_at(self, times_s: list[float]) -> None:
        for n, at_s in enumerate(times_s):
            await asyncio.sleep(max(0.0, self.t0 + at_s - time.monotonic()))
            await self.rebalance_once(n)

    async def rebalance_once(self, n: int) -> None:
        """A second member of the group for `rebalance_hold_s`: it takes half the partitions, reads nothing,
        commits nothing, and leaves; the worker gets them back and serves what waited there."""
        from worker.transport.kafka.kafka_clients import make_consumer

        member = make_consumer(self.kafka, WorkerSettings(worker_id=f"soak-member-{self.run_id}-{n}",
                                                          metrics_port=0))
        member.subscribe([self.kafka.request_topic])
        await member.start()
        started = time.monotonic() - self.t0
        deadline = time.monotonic() + 30
        while not member.assignment() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        member.pause(*member.assignment())
        rebalance = {"joined_s": round(started, 1), "partitions": sorted(tp.partition for tp in member.assignment())}
        self.rebalances.append(rebalance)
        await asyncio.sleep(self.args.rebalance_hold_s)
        await member.stop()
        rebalance["left_s"] = round(time.monotonic() - self.t0, 1)

    async def run(self) -> dict:
        from confluent_kafka import Producer

        args = self.args
        self.start_worker()
        reader = asyncio.create_task(self.read_loop())
        producer = Producer({"bootstrap.servers": self.kafka.bootstrap_servers, "linger.ms": 5,
                             "enable.idempotence": True})
        try:
            deadline = time.monotonic() + args.start_timeout_s
            while not self.ready.is_set():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker not ready (exit {self.proc.poll()}); log {self.log_path}")
                await asyncio.sleep(0.2)
            duration = args.minutes * 60.0
            self.t0 = time.monotonic()
            sampler = asyncio.create_task(self.sample_loop())
            count = args.rebalances if args.rebalance else 0
            times = [duration * (k + 1) / (count + 1) for k in range(count)]
            extra = [asyncio.create_task(self.rebalance_at(times))] if times else []
            await self.send_loop(producer, duration)
            drain_deadline = time.monotonic() + args.drain_s
            while self.sent_at and time.monotonic() < drain_deadline and self.proc.poll() is None:
                await asyncio.sleep(0.5)
            await asyncio.gather(*extra)
            sampler.cancel()
            summary = self.summary(duration)
            summary["worker_exit"] = await self.stop_worker()
            return summary
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self.stop_worker()
            self.log.close()

    async def stop_worker(self) -> int | None:
        """SIGTERM (SIGKILL after 60 s); the worker's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        return self.proc.returncode

    def mapping_growth(self, warmup: float) -> dict | None:
        """Resident growth by mapping from the first snapshot after warm-up to the last."""
        after = [snap for snap in self.snapshots if snap["t"] >= warmup]
        return mapping_growth(after[0], after[-1]) if len(after) > 1 else None

    def summary(self, duration: float) -> dict:
        args = self.args
        warmup = args.warmup_minutes * 60.0 if args.warmup_minutes is not None else min(300.0, duration / 3)
        minute5 = (240.0, 300.0) if duration >= 360 else (warmup, min(duration, warmup + 60.0))
        first_rebalance, last_rebalance = (self.rebalances[0], self.rebalances[-1]) if self.rebalances else ({}, {})
        last = (duration - 60.0, duration)

        def latency_p50(window: tuple[float, float]) -> float | None:
            inside = [lat for t, lat in self.latencies if window[0] <= t < window[1]]
            return round(statistics.median(inside), 3) if inside else None

        return {
            "kind": args.kind, "engine": args.engine, "rate": args.rate, "minutes": args.minutes,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "worker_env": args.worker_env,
            "warmup_s": warmup, "num_sent": self.num_sent, "num_finals": len(self.final_times),
            "num_missing": len(self.sent_at), "statuses": self.statuses,
            "rebalance": self.rebalances[0] if self.rebalances else {}, "rebalances": self.rebalances,
            "growth": growth(self.samples, warmup),
            # A rebalance hands a burst of requests back at once: a one-off rise to a larger batch's high-water
            # mark, which the windows before the first and after the last leave out.
            "growth_before_rebalance": growth(self.samples, warmup, first_rebalance.get("joined_s", 0.0)),
            "growth_after_rebalance": growth(self.samples, last_rebalance.get("left_s", float("inf")) + BURST_SETTLE_S),
            "rebalance_steps": [rebalance_step(self.samples, r) for r in self.rebalances if "left_s" in r],
            # A run longer than the floor's 30 minutes, judged as consecutive 30-minute soaks (the first from
            # the warm-up's end): whether what the first grew the next one keeps growing, or it has settled.
            "growth_by_half_hour": [growth(self.samples, max(warmup, start), start + HALF_HOUR_S)
                                    for start in range(0, int(duration), int(HALF_HOUR_S))
                                    if start + HALF_HOUR_S <= duration + 1.0],
            "floor_kb_per_1000": FLOOR_KB_PER_1000,
            "resident_by_mapping": self.mapping_growth(warmup),
            "finals_per_s": {"minute_5_window": list(minute5),
                             "minute_5": round(window_rate(self.final_times, *minute5), 3),
                             "last_minute": round(window_rate(self.final_times, *last), 3)},
            "e2e_p50_s": {"minute_5": latency_p50(minute5), "last_minute": latency_p50(last)},
            "tables_at_end": self.samples[-1].tables if self.samples else {},
            "tables_max": {name: max(s.tables.get(name, 0) for s in self.samples)
                           for name in (self.samples[-1].tables if self.samples else {})},
        }


def plot(samples: list[Sample], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    minutes = [s.t / 60 for s in samples]
    top.plot(minutes, [(s.rss_bytes or 0) / 2**20 for s in samples], label="RSS")
    top.plot(minutes, [(s.native_in_use_bytes or 0) / 2**20 for s in samples], label="glibc heap in use")
    top.axvline(summary["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    for n, rebalance in enumerate(r for r in summary.get("rebalances", []) if "left_s" in r):
        top.axvspan(rebalance["joined_s"] / 60, rebalance["left_s"] / 60, color="orange", alpha=0.2,
                    label=None if n else "second group member")
    top.set_ylabel("MB")
    top.legend(loc="center right")
    g = summary["growth"]
    top.set_title(f"soak {summary['kind']} at {summary['rate']}/s: RSS {g['rss_kb_per_1000']} KB per 1,000 "
                  f"requests after warm-up")
    bottom.plot(minutes, [s.python_blocks or 0 for s in samples], label="Python allocated blocks", color="C2")
    bottom.set_ylabel("blocks")
    bottom.set_xlabel("minutes")
    twin = bottom.twinx()
    twin.plot(minutes, [s.num_finals for s in samples], color="C3", label="finals")
    twin.set_ylabel("finals")
    bottom.legend(loc="upper left")
    twin.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second, open loop")
    p.add_argument("--kind", choices=("mix", *KINDS), default="mix")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--unknown-cancels", type=float, default=0.1, help="cancels of unknown ids per request")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rebalances", type=int, default=1, help="how many, evenly spaced (1: midway)")
    p.add_argument("--rebalance-hold-s", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=None, help="default: a third of the run, at most 5")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--mappings-every-s", type=float, default=60.0,
                   help="how often to record the worker's mappings (/proc/<pid>/smaps); 0: never")
    p.add_argument("--engine", choices=("llm", "instant"), default="llm")
    p.add_argument("--instant-step-ms", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    p.add_argument("--worker-env", action="append", default=[], help="KEY=VALUE for the worker (repeatable)")
    p.add_argument("--worker-wrapper", default="",
                   help="a command the worker runs under, e.g. 'heaptrack -o PATH' (RSS is then the wrapper's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-s", type=float, default=180.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--label", default="", help="suffix of the results folder")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict:
    from benchmarks.bench_kafka_path import (
        kafka_session,  # torch and the model runner: not for the unit tests
    )

    with kafka_session(prefix="bench-soak-") as session:
        suffix = uuid.uuid4().hex[:8]
        kafka = KafkaSettings(bootstrap_servers=session.bootstrap, request_topic=f"soak.requests.{suffix}",
                              result_topic=f"soak.results.{suffix}", dead_letter_topic=f"soak.dlq.{suffix}",
                              status_topic=f"soak.status.{suffix}", control_topic=f"soak.control.{suffix}",
                              group_id=f"soak-{suffix}")
        await ensure_topics(kafka)
        soak = Soak(args, kafka, session.tmp / "worker.log")
        try:
            summary = await soak.run()
        except BaseException:
            session.keep = True
            raise
        if summary["num_missing"] or summary["worker_exit"] not in (0, None):
            session.keep = True
        date = datetime.date.today().isoformat()
        name = f"{date}-soak" + (f"-{args.label}" if args.label else "")
        out = args.out or REPO / "benchmarks" / "results" / name
        raw = REPO / "benchmarks" / "results" / "raw" / name
        out.mkdir(parents=True, exist_ok=True)
        raw.mkdir(parents=True, exist_ok=True)
        (raw / f"samples-{args.kind}.json").write_text(json.dumps([asdict(s) for s in soak.samples]))
        (raw / f"mappings-{args.kind}.json").write_text(json.dumps(soak.snapshots))
        summary["command"] = "python -m benchmarks.bench_soak " + " ".join(args.argv)
        (out / f"summary-{args.kind}.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(soak.samples, summary, out / f"memory-{args.kind}.png")
        summary["written_to"] = str(out)
        return summary


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    summary = asyncio.run(amain(args))
    g, f = summary["growth"], summary["finals_per_s"]
    print(json.dumps(summary, indent=2))
    after = summary["growth_after_rebalance"]
    print(f"\n{summary['kind']}: {summary['num_finals']}/{summary['num_sent']} finals, RSS {g['rss_mb_at_warmup']} -> "
          f"{g['rss_mb_at_end']} MB after warm-up; growth per 1,000 requests: RSS {g['rss_kb_per_1000']} KB "
          f"(floor {FLOOR_KB_PER_1000:.0f}; anonymous {g['rss_anon_kb_per_1000']} KB, file-backed "
          f"{g['rss_file_kb_per_1000']} KB), glibc in use {g['native_in_use_kb_per_1000']} KB, Python blocks "
          f"{g['python_blocks_per_1000']}; after the rebalance: RSS {after['rss_kb_per_1000']} KB, glibc in use "
          f"{after['native_in_use_kb_per_1000']} KB; finals/s minute 5 {f['minute_5']} vs last minute "
          f"{f['last_minute']}")
    for n, step in enumerate(summary["rebalance_steps"]):
        print(f"rebalance {n + 1} at {step['joined_s'] / 60:.1f} min: RSS {step['rss_kb']:+} KB, glibc in use "
              f"{step['native_in_use_kb']:+} KB, Python blocks {step['python_blocks']:+}")
    half_hours = summary["growth_by_half_hour"]
    for n, half_hour in enumerate(half_hours if len(half_hours) > 1 else []):
        print(f"minutes {30 * n}-{30 * n + 30} (from the warm-up's end): RSS {half_hour['rss_kb_per_1000']} KB per "
              f"1,000, glibc in use {half_hour['native_in_use_kb_per_1000']} KB, RSS {half_hour['rss_mb_at_warmup']}"
              f" -> {half_hour['rss_mb_at_end']} MB")
    return 0 if not summary["num_missing"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
