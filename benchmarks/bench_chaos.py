"""Chaos benchmark: real-model workers SIGKILLed on a schedule while they serve; what does a read_committed reader
see, and what does exactly-once cost?

A LocalBroker on free ports, fresh topics, `--workers` `llm-worker serve` processes on the default model (CPU,
one thread each, lag shedding off so every request is served), and an open-loop producer at `--rate` requests/s
of mixed prompt and output lengths (so requests finish out of offset order). Every `--kill-every-s` one worker,
in turn, is SIGKILLed and a new one started in its place. A reader with isolation.level=read_committed takes the
result, status and usage topics from their start. When every request has its final (or `--timeout-s` passes):

- duplicate and missing finals (ids with more than one final, ids with none);
- streams: for each final, the stream it ends must be seq 0..num_chunks-1, no gap, no repeat: its attempt's
  chunks and, when that attempt resumed an earlier one's stream (`resumed_at`), the earlier chunks below it;
- usage: one committed usage record per request, summing to the finals' prompt/cached/output tokens;
- tokens generated twice: output tokens streamed under an attempt that a later attempt superseded and that the
  later one generated again (those below its resume point it kept), against all tokens streamed under superseded
  attempts (what restarting from zero, as workers did before streams resumed, would generate again).

`--throughput` runs the other measure instead: `--requests` preloaded, no kills, the same workers with
KAFKA_EXACTLY_ONCE on and off in turn (`--reps` each); finals/s from the first assignment to the last final.

Writes summary-chaos.json (or summary-throughput.json) under benchmarks/results/<date>-chaos[-label]/; worker
logs stay in the session's temporary folder (printed when kept). The issue's runs:

    .venv/bin/python -m benchmarks.bench_chaos --requests 2000 --workers 3 --kill-every-s 30 --rate 6
    .venv/bin/python -m benchmarks.bench_chaos --throughput --requests 400 --workers 3 --reps 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.decode import decode_result, decode_status, decode_usage, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest, SamplingSpec
from schemas.result import FinalRecord, StreamChunk
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings

REPO = Path(__file__).resolve().parents[1]
NO_SHEDDING = "[1000000.0, 1000000.0, 1000000.0]"


def make_request(i: int, run_id: str, rng: random.Random) -> tuple[int, GenerationRequest]:
    words = rng.randint(4, 80)
    tokens = rng.choice((2, 4, 8, 12, 16, 24, 32))
    return i % 3, GenerationRequest(
        id=f"chaos-{run_id}-{i}", prompt=f"request {i}: " + " ".join(["tell me about kafka"] * (words // 4 + 1)),
        max_new_tokens=tokens, sampling=SamplingSpec(ignore_eos=True))


class Fleet:
    """The worker processes; a killed one is replaced by a new one under a new id."""

    def __init__(self, kafka: KafkaSettings, tmp: Path, exactly_once: bool, progress: bool = True) -> None:
        self.kafka, self.tmp, self.exactly_once, self.progress = kafka, tmp, exactly_once, progress
        self.procs: dict[str, subprocess.Popen] = {}
        self.num_started = 0
        self.kills: list[dict] = []

    def env(self, worker_id: str) -> dict[str, str]:
        k = self.kafka
        env = dict(os.environ)
        env.update({
            "KAFKA_BOOTSTRAP_SERVERS": k.bootstrap_servers, "KAFKA_REQUEST_TOPIC": k.request_topic,
            "KAFKA_RESULT_TOPIC": k.result_topic, "KAFKA_DEAD_LETTER_TOPIC": k.dead_letter_topic,
            "KAFKA_STATUS_TOPIC": k.status_topic, "KAFKA_CONTROL_TOPIC": k.control_topic,
            "KAFKA_USAGE_TOPIC": k.usage_topic,
            # A topic that does not exist turns the progress records off (one WARNING): the cost of resuming.
            "KAFKA_PROGRESS_TOPIC": k.progress_topic if self.progress else f"{k.progress_topic}.absent",
            "KAFKA_GROUP_ID": k.group_id,
            "KAFKA_EXACTLY_ONCE": "true" if self.exactly_once else "false",
            "WORKER_WORKER_ID": worker_id, "WORKER_METRICS_PORT": "0", "WORKER_MAX_QUEUE_TIME_S": NO_SHEDDING,
            "WORKER_SESSION_TIMEOUT_S": "6", "WORKER_STATUS_INTERVAL_S": "0.5",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ENGINE_DEVICE": "cpu",
        })
        return env

    def start(self) -> str:
        worker_id = f"w{self.num_started}"
        self.num_started += 1
        log = open(self.tmp / f"{worker_id}.log", "wb")
        self.procs[worker_id] = subprocess.Popen([str(REPO / ".venv/bin/llm-worker"), "serve"], cwd=REPO,
                                                 stdout=log, stderr=log, env=self.env(worker_id))
        return worker_id

    def kill_one(self, t: float) -> str:
        victim = min(self.procs, key=lambda worker_id: int(worker_id[1:]))  # the oldest: each in turn
        self.procs.pop(victim).send_signal(signal.SIGKILL)
        replacement = self.start()
        self.kills.append({"t_s": round(t, 1), "killed": victim, "started": replacement})
        return victim

    def cpu_s(self) -> float:
        return sum(cpu_seconds(proc.pid) for proc in self.procs.values())

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


class Reader:
    """read_committed: results, statuses and usage records, from the start of each topic."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.finals: dict[str, list[FinalRecord]] = {}
        self.chunks: dict[tuple[str, int], list[StreamChunk]] = {}
        self.usage: dict[str, list] = {}
        self.assigned: dict[str, list[int]] = {}
        self.first_assigned_at: float | None = None
        self.last_final_at = 0.0
        self.statuses: list = []
        self.assignment_changes: list[float] = []
        self.final_times: list[float] = []

    async def run(self) -> None:
        k = self.kafka
        consumer = AIOKafkaConsumer(k.result_topic, k.status_topic, k.usage_topic, **k.client_kwargs(), group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    isolation_level="read_committed")
        await consumer.start()
        try:
            while True:
                for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                    for m in messages:
                        self.take(tp.topic, m.value)
        finally:
            await consumer.stop()

    def take(self, topic: str, value: bytes) -> None:
        if topic == self.kafka.status_topic:
            status = decode_status(value)
            if self.assigned.get(status.worker_id) != status.assigned_partitions:
                self.assignment_changes.append(time.monotonic())
            self.assigned[status.worker_id] = status.assigned_partitions
            self.statuses.append((time.monotonic(), status))
            if status.assigned_partitions and self.first_assigned_at is None:
                self.first_assigned_at = time.monotonic()
        elif topic == self.kafka.usage_topic:
            record = decode_usage(value)
            self.usage.setdefault(record.id, []).append(record)
        else:
            record = decode_result(value)
            if isinstance(record, FinalRecord):
                self.finals.setdefault(record.id, []).append(record)
                self.last_final_at = time.monotonic()
                self.final_times.append(self.last_final_at)
            else:
                self.chunks.setdefault((record.id, record.attempt), []).append(record)

    def covered(self, worker_ids: set[str], num_partitions: int) -> bool:
        owned = sorted(p for w, parts in self.assigned.items() if w in worker_ids for p in parts)
        return owned == list(range(num_partitions))


def judge(reader: Reader, ids: list[str]) -> dict:
    duplicates = {i: len(reader.finals[i]) for i in ids if len(reader.finals.get(i, [])) > 1}
    missing = [i for i in ids if not reader.finals.get(i)]
    gaps = repeats = 0
    twice = superseded = total = resumed = restarted = 0
    for i in ids:
        finals = reader.finals.get(i)
        if not finals:
            continue
        final = finals[-1]
        stream = stitched(reader, final)
        seqs = [c.seq for c in stream]
        repeats += len(seqs) - len(set(seqs))
        gaps += len(set(range(final.num_chunks)) - set(seqs))
        total += final.usage.completion_tokens
        older = sum(len(c.token_ids) for (rid, attempt), chunks in reader.chunks.items()
                    if rid == i and attempt < final.attempt for c in chunks)
        kept = sum(len(c.token_ids) for c in stream if c.attempt < final.attempt)
        superseded += older
        twice += older - kept
        if older:
            resumed += final.resumed_at is not None
            restarted += final.resumed_at is None
    usage_dup = sum(1 for i in ids if len(reader.usage.get(i, [])) > 1)
    usage_missing = sum(1 for i in ids if not reader.usage.get(i))
    sums = {}
    for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        sums[field] = {"finals": sum(getattr(reader.finals[i][-1].usage, field) for i in ids if reader.finals.get(i)),
                       "usage": sum(getattr(u, field) for i in ids for u in reader.usage.get(i, []))}
    return {"num_duplicate_finals": len(duplicates), "num_missing_finals": len(missing),
            "num_seq_gaps": gaps, "num_seq_repeats": repeats,
            "usage_records_duplicate": usage_dup, "usage_records_missing": usage_missing,
            "usage_sums": sums, "usage_sums_equal": all(v["finals"] == v["usage"] for v in sums.values()),
            "output_tokens_final": total, "output_tokens_generated_twice": twice,
            "output_tokens_under_superseded_attempts": superseded,
            "generated_twice_vs_restart_from_zero": round(twice / superseded, 4) if superseded else None,
            "generated_twice_fraction": round(twice / total, 4) if total else None,
            "requests_moved": resumed + restarted, "requests_resumed": resumed, "requests_restarted": restarted,
            "statuses": {s: sum(1 for i in ids if reader.finals.get(i) and reader.finals[i][-1].status == s)
                         for s in ("completed", "rejected", "error", "cancelled")},
            "duplicate_examples": dict(list(duplicates.items())[:5]), "missing_examples": missing[:5]}


def stitched(reader: Reader, final: FinalRecord) -> list[StreamChunk]:
    """The chunks of the stream `final` ends: its attempt's, and below its resume point the earlier attempts'
    (the latest attempt's where several wrote one seq), as a reader following `resumed_at` keeps them."""
    mine = reader.chunks.get((final.id, final.attempt), [])
    if final.resumed_at is None:
        return list(mine)
    earlier: dict[int, StreamChunk] = {}
    for (rid, attempt), chunks in sorted(reader.chunks.items(), key=lambda kv: kv[0][1]):
        if rid == final.id and attempt < final.attempt:
            earlier.update({c.seq: c for c in chunks if c.seq < final.resumed_at})
    return [earlier[seq] for seq in sorted(earlier)] + list(mine)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_cpu_s(tmp: Path) -> float:
    """CPU seconds of the session's broker (the java process whose command line names its folder)."""
    total = 0.0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp).encode() in cmdline.read_bytes() and b"kafka" in cmdline.read_bytes():
                total += cpu_seconds(int(cmdline.parent.name))
        except OSError:
            continue
    return total


def fresh_topics(bootstrap: str, name: str) -> KafkaSettings:
    s = uuid.uuid4().hex[:8]
    return KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"{name}.requests.{s}",
                         result_topic=f"{name}.results.{s}", dead_letter_topic=f"{name}.dlq.{s}",
                         status_topic=f"{name}.status.{s}", control_topic=f"{name}.control.{s}",
                         usage_topic=f"{name}.usage.{s}", progress_topic=f"{name}.progress.{s}",
                         group_id=f"{name}-{s}")


async def produce(kafka: KafkaSettings, requests: list[tuple[int, GenerationRequest]], rate: float | None) -> None:
    producer = AIOKafkaProducer(**kafka.client_kwargs(), acks="all")
    await producer.start()
    try:
        start = time.monotonic()
        for n, (priority, request) in enumerate(requests):
            if rate:
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            partition = partition_for(priority, request.routing_key, kafka.num_request_partitions,
                                      kafka.num_priorities)
            await producer.send(kafka.request_topic, encode(request), key=request.id.encode(), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.2)


async def chaos(args: argparse.Namespace, bootstrap: str, tmp: Path) -> dict:
    kafka = fresh_topics(bootstrap, "chaos")
    await ensure_topics(kafka)
    rng = random.Random(args.seed)
    run_id = uuid.uuid4().hex[:6]
    requests = [make_request(i, run_id, rng) for i in range(args.requests)]
    ids = [q.id for _, q in requests]
    reader = Reader(kafka)
    reading = asyncio.create_task(reader.run())
    fleet = Fleet(kafka, tmp, exactly_once=True)
    for _ in range(args.workers):
        fleet.start()
    try:
        await wait_for(lambda: reader.covered(set(fleet.procs), kafka.num_request_partitions), 300, "first assignment")
        t0 = time.monotonic()
        producing = asyncio.create_task(produce(kafka, requests, args.rate))
        next_kill = t0 + args.kill_every_s
        while not all(reader.finals.get(i) for i in ids):
            if time.monotonic() - t0 > args.timeout_s:
                break
            if args.kill_every_s and time.monotonic() >= next_kill:
                victim = fleet.kill_one(time.monotonic() - t0)
                print(f"{time.monotonic() - t0:7.1f} s  SIGKILL {victim}; {sum(1 for i in ids if reader.finals.get(i))}"
                      f"/{len(ids)} answered", flush=True)
                next_kill += args.kill_every_s
            await asyncio.sleep(0.2)
        wall_s = time.monotonic() - t0
        await producing
        await asyncio.sleep(5.0)  # a late duplicate would show within a few transaction intervals
    finally:
        fleet.stop()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    out = judge(reader, ids)
    out.update({"requests": len(ids), "workers": args.workers, "rate": args.rate, "kills": fleet.kills,
                "num_kills": len(fleet.kills), "wall_s": round(wall_s, 1),
                "finals_per_s": round(sum(1 for i in ids if reader.finals.get(i)) / wall_s, 3)})
    return out


async def throughput_once(args: argparse.Namespace, bootstrap: str, tmp: Path, system: str, rep: int) -> dict:
    """One run of `system`: "exactly-once", "exactly-once-no-progress" (no progress records: streams restart) or
    "at-least-once"."""
    kafka = fresh_topics(bootstrap, "tput")
    await ensure_topics(kafka)
    rng = random.Random(args.seed + rep)
    requests = [make_request(i, uuid.uuid4().hex[:6], rng) for i in range(args.requests)]
    ids = [q.id for _, q in requests]
    await produce(kafka, requests, None)
    reader = Reader(kafka)
    reading = asyncio.create_task(reader.run())
    exactly_once = system != "at-least-once"
    fleet = Fleet(kafka, tmp / f"{system}{rep}", exactly_once, progress=system == "exactly-once")
    fleet.tmp.mkdir(parents=True, exist_ok=True)
    broker_cpu_at_start = broker_cpu_s(tmp)
    for _ in range(args.workers):
        fleet.start()
    try:
        await wait_for(lambda: reader.first_assigned_at is not None, 300, "first assignment")
        await wait_for(lambda: all(reader.finals.get(i) for i in ids), args.timeout_s, "every final")
        worker_cpu = fleet.cpu_s()
        broker_cpu = broker_cpu_s(tmp) - broker_cpu_at_start
        await asyncio.sleep(1.0)
    finally:
        fleet.stop()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    wall = reader.last_final_at - reader.first_assigned_at
    # Where the time went: the group settles (the last assignment change), then the steady rate; the engines'
    # batches and the partitions paused, from the status records (every 0.5 s per worker).
    settled_at = max([t for t in reader.assignment_changes if t <= reader.last_final_at],
                     default=reader.first_assigned_at)
    after = sum(1 for t in reader.final_times if t > settled_at)
    statuses = [st for t, st in reader.statuses if reader.first_assigned_at <= t <= reader.last_final_at]
    moved = judge(reader, ids)
    return {"system": system, "exactly_once": exactly_once, "rep": rep, "wall_s": round(wall, 2),
            "finals_per_s": round(len(ids) / wall, 3),
            "output_tokens_per_s": round(sum(reader.finals[i][-1].usage.completion_tokens for i in ids) / wall, 1),
            "settled_after_s": round(settled_at - reader.first_assigned_at, 1),
            "finals_before_settled": len(ids) - after,
            "finals_per_s_after_settled": round(after / max(reader.last_final_at - settled_at, 1e-9), 3),
            "mean_running": round(sum(st.num_running for st in statuses) / max(len(statuses), 1), 2),
            "mean_waiting": round(sum(st.num_waiting for st in statuses) / max(len(statuses), 1), 2),
            "share_paused": round(sum(1 for st in statuses if st.paused_partitions) / max(len(statuses), 1), 3),
            "share_commit_waiting": round(sum(1 for st in statuses if st.commit_waiting_partitions)
                                          / max(len(statuses), 1), 3),
            "requests_resumed": moved["requests_resumed"], "requests_restarted": moved["requests_restarted"],
            "worker_cpu_s": round(worker_cpu, 1), "broker_cpu_s": round(broker_cpu, 1),
            "load_at_end": os.getloadavg()[0]}


async def warm_broker(bootstrap: str) -> None:
    """A transaction and a group commit on the fresh broker, so neither system pays for the broker's internal
    topics (__transaction_state: 50 partitions made on the first transactional id; __consumer_offsets) inside
    its measurement, as no long-running cluster does."""
    kafka = fresh_topics(bootstrap, "warm")
    await ensure_topics(kafka)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"warm-{uuid.uuid4().hex[:8]}")
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(kafka.result_topic, b"warm")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(kafka.result_topic, bootstrap_servers=bootstrap, group_id=kafka.group_id,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        await consumer.getmany(timeout_ms=2000)
        await consumer.commit()
    finally:
        await consumer.stop()


async def amain(args: argparse.Namespace) -> dict:
    from benchmarks.bench_kafka_path import kafka_session  # the broker helpers: not for the unit tests

    with kafka_session(prefix="bench-chaos-") as session:
        summary: dict = {"load_at_start": os.getloadavg()[0], "cpus": os.cpu_count()}
        if args.throughput:
            await warm_broker(session.bootstrap)
            runs = []
            systems = args.systems.split(",")
            for rep in range(args.reps):
                for system in systems if rep % 2 == 0 else systems[::-1]:  # alternating order: drift cancels
                    run = await throughput_once(args, session.bootstrap, session.tmp, system, rep)
                    print(json.dumps(run), flush=True)
                    runs.append(run)

            def mean_rate(system: str) -> float:
                rates = [r["finals_per_s"] for r in runs if r["system"] == system]
                return sum(rates) / len(rates)

            base = mean_rate("at-least-once") if "at-least-once" in systems else None
            summary.update({"kind": "throughput", "runs": runs,
                            "ratio_to_at_least_once": {s: round(mean_rate(s) / base, 3) for s in systems}
                            if base else {}})
        else:
            session.keep = args.keep
            summary.update({"kind": "chaos", **await chaos(args, session.bootstrap, session.tmp)})
            if summary["num_duplicate_finals"] or summary["num_missing_finals"]:
                session.keep = True
        summary["command"] = "python -m benchmarks.bench_chaos " + " ".join(args.argv)
        date = datetime.date.today().isoformat()
        out = REPO / "benchmarks" / "results" / (f"{date}-chaos" + (f"-{args.label}" if args.label else ""))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"summary-{summary['kind']}.json").write_text(json.dumps(summary, indent=2) + "\n")
        summary["written_to"] = str(out)
        return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate", type=float, default=6.0, help="requests/s, open loop")
    p.add_argument("--kill-every-s", type=float, default=30.0, help="0: no kills")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--throughput", action="store_true", help="exactly-once on against off, no kills")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--systems", default="exactly-once,at-least-once",
                   help="with --throughput: any of exactly-once, exactly-once-no-progress, at-least-once")
    p.add_argument("--label", default="")
    p.add_argument("--keep", action="store_true", help="keep the broker data and worker logs (the path is printed)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    summary = asyncio.run(amain(parse_args(argv)))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
