"""Kafka-path benchmark: one trace through LLMEngine in-process and through the whole Kafka path.

(a) in-process: `bench_engine.run_engine_policy` (continuous policy) on a ModelRunner loaded in this process.
(b) Kafka path: a LocalBroker on free ports (temporary data folder), fresh topics per repetition, one
    `llm-worker serve` subprocess (continuous policy) with the same engine settings as (a) (passed as
    ENGINE_* variables: max_num_seqs, max_num_batched_tokens, block size, KV bytes, max_model_len, prefix
    caching off, float32 on the CPU) and the same torch thread count (OMP_NUM_THREADS / MKL_NUM_THREADS, which
    torch reads at start-up; the worker sets no thread count of its own). Requests carry prompt_token_ids,
    ignore_eos=True and the trace's max_new_tokens, written to the partition of their priority. They are sent
    only once the worker has joined the group (a status record listing every request partition) and has
    served a small warm-up; offline (rate 0) they are all sent at once. Times are read on the client: TTFT =
    first stream chunk, e2e = final record, both from the request's trace arrival after the first send;
    output tok/s = completed output tokens / (last final - first send).

Repetitions alternate in-process and Kafka runs in ABBA order so drift in machine load affects both.

`--security sasl_ssl` (or ssl, sasl_plaintext) adds a third system: the same Kafka run against a second local
broker with that listener (benchmarks/lib/broker_target.py), the worker connecting as the `worker` principal and the
client as `client`, each under its ACLs. Its output tok/s over the plaintext Kafka run's (ratio of medians) is
checked against SECURED_FLOOR.
Shedding is switched off in the worker (WORKER_MAX_QUEUE_TIME_S very large): the in-process engine never
sheds, and a saturating offline trace would otherwise trip it.

Writes summary.json (every repetition's metrics) and report.md to benchmarks/results/<date>-kafka-path/, the
trace and the full results.json (each request's record too) to the git-ignored
benchmarks/results/raw/<date>-kafka-path/ (benchmarks/lib/results_store.py).

    .venv/bin/python -m benchmarks.bench_kafka_path --num-requests 24 --reps 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from benchmarks.bench_engine import run_engine_policy
from benchmarks.lib.broker_target import Target, start_broker as start_target
from benchmarks.lib.floors import KAFKA_FLOOR
from benchmarks.lib.run_result import RequestRecord, RunResult, compute_metrics, records_to_json
from benchmarks.lib.results_store import raw_dir, write_results
from benchmarks.lib.settings import DEFAULT_MODEL, engine_settings, load_runner, min_token_id, set_threads
from benchmarks.lib.trace import Trace, TraceConfig, TraceRequest, generate_trace, is_offline
from schemas.decode import decode_result, decode_status, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest, SamplingSpec
from schemas.result import FinalRecord, StreamChunk
from schemas.status import WorkerStatus
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings
from worker.model.runner import ModelRunner

REPO = Path(__file__).resolve().parents[1]

NO_SHEDDING = "[1000000.0, 1000000.0, 1000000.0]"
SECURED_FLOOR = 0.90
"""Kafka-path output tok/s over a secured listener / over plaintext, in one run, must stay at or above this."""


# ---- pure bookkeeping (unit-tested) ---------------------------------------------------------------------


@dataclass
class ResultTracker:
    """Client-side view of the results of one run: which requests are awaited, first chunk and final times.

    `on_record` takes a decoded result record and the seconds since the first send; records of ids not
    awaited (warm-up, another run) and repeats (a redelivered attempt's chunks) change nothing."""

    records: dict[str, RequestRecord]
    worker_ttft_ms: dict[str, float] = field(default_factory=dict)
    last_final_s: float | None = None

    @classmethod
    def for_trace(cls, requests: list[TraceRequest]) -> "ResultTracker":
        return cls({r.request_id: RequestRecord(r.request_id, r.kind, r.priority, r.arrival_s, r.num_prompt_tokens)
                    for r in requests})

    @property
    def num_finished(self) -> int:
        return sum(r.finish_s is not None for r in self.records.values())

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.records)

    def on_record(self, record: StreamChunk | FinalRecord, now_s: float) -> None:
        rec = self.records.get(record.id)
        if rec is None or rec.finish_s is not None:
            return
        if isinstance(record, StreamChunk):
            if rec.first_token_s is None and record.token_ids:
                rec.first_token_s = now_s
            return
        rec.finish_s = now_s
        rec.num_output_tokens = record.usage.completion_tokens
        if record.status != "completed":
            rec.error = record.reason
        elif rec.first_token_s is None and rec.num_output_tokens:
            rec.first_token_s = now_s  # stream=False: the final record is the first the client sees
        if record.timings.ttft_ms is not None:
            self.worker_ttft_ms[record.id] = record.timings.ttft_ms
        self.last_final_s = now_s if self.last_final_s is None else max(self.last_final_s, now_s)


def _ratio(base: list[dict], other: list[dict], names: tuple[str, str], floor: float) -> dict:
    """`other`'s output tok/s over `base`'s: per repetition (pairs in order) and as the ratio of the medians."""
    pairs = [o["output_tokens_per_s"] / b["output_tokens_per_s"] for b, o in zip(base, other)
             if b["output_tokens_per_s"] > 0]
    med_b = statistics.median(m["output_tokens_per_s"] for m in base) if base else math.nan
    med_o = statistics.median(m["output_tokens_per_s"] for m in other) if other else math.nan
    ratio = med_o / med_b if med_b and not math.isnan(med_b) else math.nan
    return {f"{names[0]}_tok_s_median": med_b, f"{names[1]}_tok_s_median": med_o, "ratio_of_medians": ratio,
            "ratio_per_rep": pairs, "floor": floor, "meets_floor": bool(ratio >= floor)}


def compare(inproc: list[dict], kafka: list[dict]) -> dict:
    """Kafka / in-process output tok/s."""
    return _ratio(inproc, kafka, ("inproc", "kafka"), KAFKA_FLOOR)


def compare_secured(kafka: list[dict], secured: list[dict]) -> dict:
    """The secured Kafka runs' output tok/s over the plaintext ones'."""
    return _ratio(kafka, secured, ("kafka", "secured"), SECURED_FLOOR)


# ---- Kafka path -----------------------------------------------------------------------------------------


def kafka_env(kafka, threads: int) -> dict[str, str]:
    """This process's environment plus the run's broker, topics and group, and the torch thread count (torch
    reads OMP_NUM_THREADS / MKL_NUM_THREADS at start-up); no metrics endpoint (port 9400 may be taken)."""
    env = dict(os.environ)
    env.update({
        "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "KAFKA_REQUEST_TOPIC": kafka.request_topic,
        "KAFKA_RESULT_TOPIC": kafka.result_topic, "KAFKA_DEAD_LETTER_TOPIC": kafka.dead_letter_topic,
        "KAFKA_STATUS_TOPIC": kafka.status_topic, "KAFKA_GROUP_ID": kafka.group_id,
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WORKER_METRICS_PORT": "0",
    })
    return env


def worker_env(kafka, model: str, max_model_len: int, threads: int, target: Target | None = None) -> dict[str, str]:
    s = engine_settings("continuous", max_model_len)
    env = kafka_env(kafka, threads)
    if target is not None:
        env.update(target.env("worker"))
    env.update({
        "ENGINE_MODEL": model, "ENGINE_POLICY": "continuous", "ENGINE_DEVICE": s.device, "ENGINE_DTYPE": s.dtype,
        "ENGINE_MAX_NUM_SEQS": str(s.max_num_seqs), "ENGINE_MAX_NUM_BATCHED_TOKENS": str(s.max_num_batched_tokens),
        "ENGINE_MAX_BATCH_SIZE": str(s.max_batch_size), "ENGINE_BLOCK_SIZE": str(s.block_size),
        "ENGINE_KV_CACHE_BYTES": str(s.kv_cache_bytes), "ENGINE_MAX_MODEL_LEN": str(s.max_model_len),
        "ENGINE_ENABLE_PREFIX_CACHING": "false",
        "WORKER_MAX_QUEUE_TIME_S": NO_SHEDDING, "WORKER_WORKER_ID": "bench-kafka-path",
    })
    env.pop("ENGINE_NUM_KV_BLOCKS", None)
    return env


async def run_kafka(bootstrap: str, trace: Trace, warmup: Trace, *, model: str, max_model_len: int, threads: int,
                    stream: bool, timeout_s: float, log_dir: Path, target: Target | None = None) -> RunResult:
    """One measured replay of `trace` through fresh topics and a fresh worker subprocess, after the worker
    has joined its group and served `warmup`; the worker is stopped on every exit. `target`: a secured broker
    (its bootstrap is `bootstrap`) and its principals."""
    run = await KafkaRun.start(bootstrap, log_dir, stream, target)
    run.start_worker(worker_env(run.kafka, model, max_model_len, threads, target))
    reader = asyncio.create_task(run.read_loop())
    try:
        started = time.monotonic()
        await run.wait_for(run.ready.is_set, "worker ready (status with every partition assigned)", 300)
        ready_s = time.monotonic() - started
        await run.replay(warmup, "warm-up finals", 120)
        tracker = await run.replay(trace, "every final record", timeout_s)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        exit_code = await run.stop()
    ttfts = list(tracker.worker_ttft_ms.values())
    return RunResult("kafka", trace.config.rate, list(tracker.records.values()), tracker.last_final_s,
                     extra={"worker_ready_s": ready_s, "worker_exit_code": exit_code, "stream": stream,
                            "worker_ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
                            "worker_log": str(run.log_path)})


class KafkaRun:
    """The client side of one Kafka run: fresh topics, a producer of requests, a consumer of the result and
    status topics, and the `llm-worker serve` subprocess, whose output goes to a log file in log_dir."""

    def __init__(self, kafka: KafkaSettings, num_result_partitions: int, num_status_partitions: int, log_path: Path,
                 stream: bool, client: KafkaSettings | None = None) -> None:
        """client: `kafka` with the client principal's connection settings (a secured broker)."""
        self.kafka = kafka
        self.stream = stream
        client = client or kafka
        self.consumer = AIOKafkaConsumer(**client.client_kwargs(), group_id=None, enable_auto_commit=False,
                                         auto_offset_reset="earliest")
        self.partitions = [TopicPartition(kafka.result_topic, p) for p in range(num_result_partitions)]
        self.partitions += [TopicPartition(kafka.status_topic, p) for p in range(num_status_partitions)]
        self.producer = AIOKafkaProducer(**client.client_kwargs(), linger_ms=0)
        self.log_path = log_path
        self.log = None
        self.proc: subprocess.Popen | None = None
        self.ready = asyncio.Event()
        """Set once a status record lists every request partition: the worker has joined its group."""
        self.tracker: ResultTracker | None = None
        """The replay whose results are awaited; records of any other run's ids are ignored."""
        self.t0 = time.monotonic()
        """When the current replay's first request was sent: its records' times count from here."""

    @classmethod
    async def start(cls, bootstrap: str, log_dir: Path, stream: bool, target: Target | None = None) -> "KafkaRun":
        suffix = uuid.uuid4().hex[:8]
        kafka = KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"kp.requests.{suffix}",
                              result_topic=f"kp.results.{suffix}", dead_letter_topic=f"kp.dlq.{suffix}",
                              status_topic=f"kp.status.{suffix}", group_id=f"kp-{suffix}")
        states = await (target.prepare(kafka) if target is not None else ensure_topics(kafka))
        run = cls(kafka, states[kafka.result_topic].num_partitions, states[kafka.status_topic].num_partitions,
                  log_dir / f"worker-{suffix}.log", stream,
                  client=target.as_("client", kafka) if target is not None else None)
        await run.consumer.start()
        run.consumer.assign(run.partitions)
        await run.producer.start()
        return run

    def start_worker(self, env: dict[str, str], nice: int | None = None, cpus: set[int] | None = None) -> None:
        """`nice`: the worker's niceness, whatever this process's (lowering it needs root); `cpus`: the only
        CPUs it may run on."""
        self.log = open(self.log_path, "wb")

        def preexec() -> None:
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            if cpus:
                os.sched_setaffinity(0, cpus)
        self.proc = subprocess.Popen([str(REPO / ".venv/bin/llm-worker"), "serve"], cwd=REPO, stdout=self.log,
                                     stderr=self.log, env=env,
                                     preexec_fn=preexec if nice is not None or cpus else None)

    async def read_loop(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=50, max_records=5000)
            now = time.monotonic()
            for tp, msgs in batches.items():
                for msg in msgs:
                    if tp.topic == self.kafka.status_topic:
                        self.on_status(decode_status(msg.value))
                    else:
                        self.on_result(decode_result(msg.value), now)

    def on_status(self, status: WorkerStatus) -> None:
        if len(status.assigned_partitions) >= self.kafka.num_request_partitions:
            self.ready.set()

    def on_result(self, record: StreamChunk | FinalRecord, now: float) -> None:
        """now: time.monotonic() when the batch holding the record was read."""
        if self.tracker is not None:
            self.tracker.on_record(record, now - self.t0)

    async def replay(self, trace: Trace, what: str, limit_s: float) -> ResultTracker:
        """Sends the trace's requests at their arrival times and waits up to `limit_s` for every final."""
        tracker = ResultTracker.for_trace(trace.requests)
        self.tracker, self.t0 = tracker, time.monotonic()
        await self.send(trace.requests, self.t0)
        await self.wait_for(lambda: tracker.done, what, limit_s)
        return tracker

    async def send(self, requests: list[TraceRequest], start: float) -> None:
        futures = []
        for r in requests:
            delay = start + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            req = GenerationRequest(id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                    max_new_tokens=r.max_new_tokens, sampling=SamplingSpec(ignore_eos=True),
                                    priority=r.priority, stream=self.stream)
            partition = partition_for(r.priority, r.request_id, self.kafka.num_request_partitions,
                                      self.kafka.num_priorities)
            futures.append(await self.producer.send(self.kafka.request_topic, encode(req),
                                                    key=r.request_id.encode(), partition=partition))
        await asyncio.gather(*futures)

    async def wait_for(self, predicate, what: str, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode} while waiting for {what}; "
                                   f"log {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached in {limit_s:.0f}s; worker log {self.log_path}")
            await asyncio.sleep(0.02)

    async def stop(self) -> int | None:
        """Stops the worker (SIGTERM, then SIGKILL after 60 s) and the clients; returns the worker's exit code."""
        exit_code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    exit_code = await asyncio.to_thread(self.proc.wait, 60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    exit_code = await asyncio.to_thread(self.proc.wait)
            else:
                exit_code = self.proc.returncode
        if self.log is not None:
            self.log.close()
        await self.producer.stop()
        await self.consumer.stop()
        return exit_code


# ---- driver (also used by benchmarks/report.py) ---------------------------------------------------------


def start_broker(tmp: Path):
    from worker.broker.local import LocalBroker, free_ports

    port, controller_port = free_ports(2)
    broker = LocalBroker(tmp / "broker", port, controller_port, detach=False)
    broker.start()
    return broker


def warmup_trace(min_token_id: int, vocab_size: int) -> Trace:
    """Two tiny offline requests that each fresh worker serves before a measured trace. Their ids start with
    `warm-` so that a late record of theirs can never be taken for one of the trace's requests (r0, r1, ...)."""
    warmup = generate_trace(TraceConfig(rate=math.inf, num_requests=2, profile="tiny", seed=12345,
                                        min_token_id=min_token_id, vocab_size=vocab_size))
    for r in warmup.requests:
        r.request_id = "warm-" + r.request_id
    return warmup


@dataclass
class KafkaSession:
    bootstrap: str
    tmp: Path
    """Broker data (when the session started the broker) and worker logs: `log_dir` of run_kafka."""
    keep: bool = False
    """Set when a run failed but the caller carried on: tmp is then kept for its worker logs."""


@contextlib.contextmanager
def kafka_session(bootstrap: str | None = None, prefix: str = "bench-kafka-") -> Iterator[KafkaSession]:
    """A LocalBroker on free ports (unless `bootstrap` names a running broker) with its data and the worker logs
    in a temporary folder. The broker is stopped on every exit (an exception, Ctrl-C); the folder is removed
    after a clean exit and kept, with a message saying where, after an exception or when `keep` was set."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    broker = None
    try:
        if not bootstrap:
            broker = start_broker(tmp)
            bootstrap = broker.bootstrap_servers
        session = KafkaSession(bootstrap, tmp)
        yield session
    except BaseException as exc:
        print(f"{type(exc).__name__}: broker data and worker logs kept in {tmp}", file=sys.stderr)
        raise
    finally:
        if broker is not None:
            broker.stop()
    if session.keep:
        print(f"broker data and worker logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def summary_row(m: dict) -> dict:
    lat = m["latency"]["all"]
    return {"system": m["system"], "rep": m.get("rep"), "done": f"{m['num_completed']}/{m['num_requests']}",
            "wall_s": m["wall_s"], "tok_s": m["output_tokens_per_s"], "ttft_p50": lat["ttft"]["p50"],
            "ttft_p99": lat["ttft"]["p99"], "e2e_p50": lat["e2e"]["p50"], "e2e_p99": lat["e2e"]["p99"],
            "load": m.get("load_at_end")}


def table(rows: list[dict]) -> str:
    head = "| system | rep | done | wall s | out tok/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | load 1m |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['system']} | {r['rep']} | {r['done']} | {r['wall_s']:.1f} | {r['tok_s']:.2f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['e2e_p50']:.2f} | {r['e2e_p99']:.2f} | "
                     f"{r['load']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s; 0 = all at t=0 (offline)")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch threads for both paths (default: settings.set_threads)")
    parser.add_argument("--no-stream", action="store_true", help="final records only (TTFT then = final)")
    parser.add_argument("--bootstrap", help="use this broker instead of starting a local one")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--security", choices=["sasl_ssl", "ssl", "sasl_plaintext"],
                        help="also run the Kafka path over a second, secured local broker and compare the two")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = list(os.getloadavg())
    threads = set_threads(args.threads)
    print(f"torch threads {threads}; load {load_before[0]:.2f}", flush=True)
    out_dir = args.out_dir or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-kafka-path"
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = load_runner(args.model, args.profile)
    low = min_token_id(runner.tokenizer)
    trace = generate_trace(TraceConfig(rate=math.inf if args.rate <= 0 else args.rate,
                                       num_requests=args.num_requests, profile=args.profile, seed=args.seed,
                                       min_token_id=low, vocab_size=runner.vocab_size))
    warmup = warmup_trace(low, runner.vocab_size)
    trace.save(raw_dir(out_dir) / "trace.json")
    inproc, kafka, secured = run_abba(args, runner, trace, warmup, threads)
    comparison = compare(inproc, kafka)
    if secured:
        comparison["secured"] = {"security": args.security, **compare_secured(kafka, secured)}
    result = {
        "environment": {"num_cpus": os.cpu_count(), "torch_threads": threads, "load_before": load_before,
                        "load_after": list(os.getloadavg()), "model": args.model, "python": sys.version.split()[0]},
        "config": {"rate": None if is_offline(trace.config.rate) else args.rate, "num_requests": args.num_requests,
                   "profile": args.profile, "seed": args.seed, "reps": args.reps, "stream": not args.no_stream,
                   "engine": json.loads(engine_settings("continuous", runner.max_model_len).model_dump_json())},
        "comparison": comparison, "inproc": inproc, "kafka": kafka, "kafka_secured": secured,
    }
    summary = {**result, **{system: [{k: v for k, v in m.items() if k != "records"} for m in result[system]]
                            for system in ("inproc", "kafka", "kafka_secured")}}  # each request's record: raw only
    write_results(out_dir, result, summary, indent=1, default=str)
    write_report(out_dir, args, argv, trace, threads, load_before, inproc, kafka, comparison, secured)
    print(f"written to {out_dir}")
    return 0


def run_abba(args: argparse.Namespace, runner: ModelRunner, trace: Trace, warmup: Trace,
             threads: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Every repetition's metrics in-process, through Kafka and (with --security) through the secured broker,
    each printed as a table row when done."""
    runs: dict[str, list[dict]] = {"inproc": [], "kafka": [], "secured": []}
    systems = ("inproc", "kafka", "secured") if args.security else ("inproc", "kafka")
    with kafka_session(args.bootstrap, prefix="bench-kafka-path-") as session:
        target = start_target(session.tmp, args.security) if args.security else None
        try:
            for rep in range(args.reps):
                # ABBA order (in-process first on even repetitions, Kafka first on odd ones): linear drift in the
                # machine's load then weighs on both paths alike.
                for system in systems if rep % 2 == 0 else systems[::-1]:
                    if system == "inproc":
                        run_engine_policy(runner, "continuous", warmup)
                        run = run_engine_policy(runner, "continuous", trace)
                    else:
                        secured = system == "secured"
                        run = asyncio.run(run_kafka(target.bootstrap if secured else session.bootstrap, trace,
                                                    warmup, model=args.model, max_model_len=runner.max_model_len,
                                                    threads=threads, stream=not args.no_stream,
                                                    timeout_s=args.timeout_s, log_dir=session.tmp,
                                                    target=target if secured else None))
                    m = compute_metrics(run)
                    m["records"] = records_to_json(run)
                    runs[system].append(m)
                    m.update(system=f"kafka {args.security}" if system == "secured" else system, rep=rep,
                             load_at_end=os.getloadavg()[0])
                    print(table([summary_row(m)]).splitlines()[-1], flush=True)
        finally:
            if target is not None:
                target.stop()
    # Worker logs are kept only for a failed run: the results hold everything a good one showed.
    for m in runs["kafka"] + runs["secured"]:
        m.pop("worker_log", None)
    return runs["inproc"], runs["kafka"], runs["secured"]


def write_report(out_dir: Path, args: argparse.Namespace, argv: list[str] | None, trace: Trace, threads: int,
                 load_before: list[float], inproc: list[dict], kafka: list[dict], comparison: dict,
                 secured: list[dict] | None = None) -> None:
    """report.md: the per-repetition table and the ratios against their floors; printed too."""
    md = table([summary_row(m) for group in zip(inproc, kafka, *([secured] if secured else [])) for m in group])
    verdict = "meets" if comparison["meets_floor"] else "BELOW"
    summary = (f"Kafka / in-process output tok/s (ratio of medians): **{comparison['ratio_of_medians']:.3f}** "
               f"({verdict} the {KAFKA_FLOOR} floor); per repetition: "
               + ", ".join(f"{r:.3f}" for r in comparison["ratio_per_rep"]))
    if secured:
        sec = comparison["secured"]
        summary += (f"\n\nKafka over {sec['security']} / over plaintext output tok/s (ratio of medians): "
                    f"**{sec['ratio_of_medians']:.3f}** ({'meets' if sec['meets_floor'] else 'BELOW'} the "
                    f"{SECURED_FLOOR} floor); per repetition: " + ", ".join(f"{r:.3f}" for r in sec["ratio_per_rep"]))
    rate = "offline (all at t=0)" if is_offline(trace.config.rate) else f"{args.rate} req/s"
    (out_dir / "report.md").write_text(
        f"# Kafka path vs in-process ({time.strftime('%Y-%m-%dT%H:%M:%S')})\n\n"
        f"{args.num_requests} requests, `{args.profile}` profile, {rate}, {args.reps} repetition(s) alternating "
        f"in-process and Kafka; continuous policy, {threads} torch thread(s), {os.cpu_count()} CPUs; 1-min load "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after. Latencies in seconds, from the client "
        f"(all requests, TTFT = first stream chunk). The broker, the client and the worker share the CPUs.\n\n"
        f"{md}\n\n{summary}\n\n"
        f"`.venv/bin/python -m benchmarks.bench_kafka_path {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(md)
    print(summary)


if __name__ == "__main__":
    raise SystemExit(main())
