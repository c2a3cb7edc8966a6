"""Overload benchmark (issue #14): capacity, then 2x and 5x of it, through Kafka and one `llm-worker serve`.

Every phase gets fresh topics and a fresh worker subprocess with the default settings (only its broker, topics
and group are set, and the torch thread count as in bench_kafka_path); it starts cold and is measured from
the moment it has joined its group (a status record lists every request partition). Requests go through
LLMClient (status-based backoff, `--no-backoff` to switch it off); a separate consumer reads every result
and status record, so a duplicate final cannot hide behind the client.

1. capacity: a closed loop keeps `--capacity-concurrency` priority-0 requests without deadline outstanding
   (each final sends the next) for `--capacity-duration` s (longer on a worker too slow to complete 40 past
   the first `--capacity-concurrency` in that time); capacity = completions after the first
   `--capacity-concurrency` ones up to the end of sending / the time between them (req/s).
2. per factor in `--factors`: Poisson arrivals at factor x capacity for `--duration` s, priorities 0/1/2
   drawn 10/30/60 %, timeout_ms 10/20/30 s; then until every request has its final record (at most the
   longest timeout + 60 s), a few seconds more for duplicates, and until the worker group's committed
   offsets reach the log end of every request partition.
3. capacity again, after the overload phases (`--no-capacity-after` skips it). The floors and the factors'
   rates use the first capacity; the report's drift table sets each phase's goodput beside both capacities
   and beside the tokens per busy second its engine computed, so a machine that sped up or slowed down
   between the phases shows as such instead of as a change of goodput.

Text prompts of 16-64 words, max_new_tokens 8 with ignore_eos, stream false, seeded. Writes summary.json
(every phase less its per-request records and status samples), report.md and timeline-<factor>x.png to
benchmarks/results/<date>-overload-control/, the full results.json and the worker logs to the git-ignored
benchmarks/results/raw/<date>-overload-control/ (benchmarks/lib/results_store.py), and exits 1 if a floor
fails (benchmarks/lib/overload_stats.py). About 5-7 minutes with the defaults on a fast CPU, 9-10 on a slow one;
`--quick` (30 s capacity loops, 15 s per factor) 3-4.

    .venv/bin/python -m benchmarks.bench_overload --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from benchmarks.bench_kafka_path import REPO, KafkaRun, kafka_env, kafka_session
from benchmarks.lib.overload_stats import (
    IN_TIME, LATE, FinalSeen, RequestLog, StatusSample, capacity_from_completions, check_floors, engine_summary,
    outcome, phase_summary, steady_span, time_series,
)
from benchmarks.lib.results_store import raw_dir, write_results
from benchmarks.lib.settings import cpu_model, set_threads
from llm_client import BackoffPolicy, LLMClient
from llm_client.commands.loadgen import make_prompt
from llm_client.commands.loadstats import poisson_gaps
from schemas.priority import priority_of_partition
from schemas.request import GenerationRequest, SamplingSpec
from schemas.result import FinalRecord, StreamChunk
from schemas.status import WorkerStatus

PRIORITY_MIX = {0: 0.1, 1: 0.3, 2: 0.6}
TIMEOUT_S = {0: 10.0, 1: 20.0, 2: 30.0}
PROMPT_WORDS = (16, 64)
MAX_NEW_TOKENS = 8
DRAIN_GRACE_S = 60.0
"""After the last arrival, how much longer than the longest timeout the finals may take."""
LINGER_S = 3.0
"""Reading on after the last final, so that a duplicate final is seen."""
CAPACITY_CONCURRENCY = 160
"""Requests the capacity loop keeps outstanding: more than the default worker takes into its engine (2 x
max_num_seqs 64 = 128), so the engine never waits for a replacement to arrive."""
OFFSETS_WAIT_S = 15.0
"""How long the worker gets (commit interval, acknowledgements) to commit up to the log end."""
PER_REQUEST_KEYS = ("requests", "statuses")
"""A phase's per-request records and status samples: in the raw results only (summary.json stays small)."""


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def worker_thread_cpu(pid: int) -> tuple[float, float] | None:
    """CPU seconds (user + system) of the process's thread named "engine" and of all its other threads, from
    /proc/<pid>/task (Linux); None where that cannot be read (the process is gone, another OS)."""
    engine = other = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is the state, the 3rd field of stat
        seconds = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: the 14th and 15th fields
        if name == "engine":
            engine += seconds
        else:
            other += seconds
    return engine, other


class OverloadRun(KafkaRun):
    """KafkaRun that keeps every final record and every status record of one phase, on the wall clock."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.t0_wall = time.time()
        self.logs: dict[str, RequestLog] = {}
        self.raw_statuses: list[WorkerStatus] = []
        self.raw_cpu: list[tuple[float, float] | None] = []
        """(engine thread, other threads) CPU seconds of the worker when each status record was read."""
        self.num_answered = self.num_send_errors = 0
        self.final_listener: Callable[[str], None] | None = None
        """Called with the request id at each request's first final record (the capacity loop's trigger)."""

    def on_status(self, status: WorkerStatus) -> None:
        super().on_status(status)
        self.raw_statuses.append(status)
        self.raw_cpu.append(worker_thread_cpu(self.proc.pid) if getattr(self, "proc", None) else None)

    def on_result(self, record: StreamChunk | FinalRecord, now: float) -> None:
        log = self.logs.get(record.id)
        if log is None or not isinstance(record, FinalRecord):
            return
        t = record.timings
        first = not log.finals
        self.num_answered += first
        log.finals.append(FinalSeen(
            record.attempt, record.status, record.reason, time.time() - self.t0_wall,
            record.usage.completion_tokens, record.message[:300], t.queue_ms, t.e2e_ms,
            getattr(t, "predicted_queue_ms", None), getattr(t, "predicted_e2e_ms", None),
            record.usage.prompt_tokens, record.usage.cached_tokens))
        if first and self.final_listener is not None:
            self.final_listener(record.id)

    def sample(self, status: WorkerStatus, cpu: tuple[float, float] | None = None) -> StatusSample:
        num_p, num_parts = self.kafka.num_priorities, self.kafka.num_request_partitions
        worker_paused = {priority_of_partition(p, num_parts, num_p) for p in status.paused_partitions
                         if 0 <= p < num_parts}
        entries = {e.priority: e for e in status.priorities}
        return StatusSample(
            status.ts_ms / 1000.0 - self.t0_wall,
            [entries[p].lag + entries[p].num_waiting if p in entries else 0 for p in range(num_p)],
            [p in worker_paused or bool(p in entries and entries[p].paused_partitions) for p in range(num_p)],
            [bool(p in entries and entries[p].shed) for p in range(num_p)],
            [entries[p].est_wait_s if p in entries else None for p in range(num_p)], status.num_running,
            status.num_preemptions, status.last_step_ms, status.num_steps, status.num_batched_tokens,
            status.busy_ms, *(cpu or (None, None)))

    @property
    def all_answered(self) -> bool:
        return self.num_answered + self.num_send_errors >= len(self.logs)


def new_request(request_id: str, timeout_s: float | None, rng: random.Random) -> GenerationRequest:
    return GenerationRequest(id=request_id, prompt=make_prompt(rng.randint(*PROMPT_WORDS), rng),
                             max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingSpec(ignore_eos=True), stream=False,
                             timeout_ms=None if timeout_s is None else int(timeout_s * 1000))


async def submit(client: LLMClient, run: OverloadRun, request: GenerationRequest, priority: int,
                 timeout_s: float | None) -> None:
    log = run.logs[request.id] = RequestLog(request.id, priority, time.time() - run.t0_wall, timeout_s)
    try:
        handle = await client.submit(request, priority)
    except Exception as exc:  # noqa: BLE001 - a failed send is an outcome of the run
        log.send_error = f"{type(exc).__name__}: {exc}"[:200]
        run.num_send_errors += 1
        return
    log.backoff_s = handle.backoff_s
    handle.close()  # the run's own consumer reads the answers


async def send_poisson(client: LLMClient, run: OverloadRun, rate: float, duration_s: float,
                       rng: random.Random, timeouts: dict[int, float] = TIMEOUT_S) -> None:
    tasks, at_s, start = [], 0.0, time.monotonic()
    gaps = poisson_gaps(rate, rng)
    while (at_s := at_s + next(gaps)) < duration_s:
        await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
        priority = rng.choices(list(PRIORITY_MIX), weights=list(PRIORITY_MIX.values()))[0]
        request = new_request(f"r{len(tasks):05d}", timeouts[priority], rng)
        tasks.append(asyncio.create_task(submit(client, run, request, priority, timeouts[priority])))
    await asyncio.gather(*tasks)


STEADY_COMPLETIONS = 40
"""Completions the capacity loop wants after its first `concurrency` ones (the warm-up it does not count)."""
STEADY_MIN_S = 30.0
"""Seconds the capacity loop goes on sending after its `concurrency`-th completion, at least. Completions come in
bursts, one per engine step (a step finishes every request whose last token it samples): on float32 on one
EPYC core a step takes ~2.5 s, and the 40 completions alone spanned ~10 s, 4 steps. The span's ends cut bursts,
so the two capacity phases of one run measured 3.48 and 4.61 req/s while the engine computed 192 tokens per busy
second in both (benchmarks/results/2026-12-01-overload-epyc-f32-drift). 30 s is ~12 steps there."""
CLOSED_LOOP_MAX_STRETCH = 4.0
"""The capacity loop sends for at most this many times --capacity-duration while it waits for them."""


async def send_closed_loop(client: LLMClient, run: OverloadRun, concurrency: int, duration_s: float,
                           rng: random.Random) -> float:
    """Keeps `concurrency` priority-0 requests without deadline outstanding for duration_s: each first final
    record sends the next. On a worker too slow to answer `concurrency` + STEADY_COMPLETIONS requests in that
    time, or to have answered the `concurrency`-th more than STEADY_MIN_S before its end (float32 on one core of
    a 2-core EPYC: ~4 req/s), it goes on until both hold, for at most CLOSED_LOOP_MAX_STRETCH x duration_s, so
    the steady span after the first `concurrency` finals has completions and steps to count. Returns when
    sending stopped, in seconds since the phase's start."""
    answered: asyncio.Queue[str] = asyncio.Queue()
    run.final_listener = answered.put_nowait
    tasks: list[asyncio.Task] = []

    def send_one() -> None:
        request = new_request(f"c{len(tasks):05d}", None, rng)
        tasks.append(asyncio.create_task(submit(client, run, request, 0, None)))

    for _ in range(concurrency):
        send_one()
    start = time.monotonic()
    end, hard_end = start + duration_s, start + CLOSED_LOOP_MAX_STRETCH * duration_s
    wanted = concurrency + STEADY_COMPLETIONS
    num_answered = 0
    warm_at = None  # when the concurrency-th final came
    try:
        while (left := (max(end, warm_at + STEADY_MIN_S) if num_answered >= wanted else hard_end)
               - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(answered.get(), min(left, hard_end - time.monotonic()))
            except TimeoutError:
                break
            num_answered += 1
            if num_answered == concurrency:
                warm_at = time.monotonic()
            send_one()
    finally:
        run.final_listener = None
    stopped_s = time.time() - run.t0_wall
    await asyncio.gather(*tasks)
    return stopped_s


async def offsets_vs_end(run: OverloadRun, limit_s: float) -> dict[int, list[int]]:
    """Per request partition [committed, log end], polled until they agree or limit_s has passed."""
    tps = [TopicPartition(run.kafka.request_topic, p) for p in range(run.kafka.num_request_partitions)]
    admin = AIOKafkaAdminClient(**run.kafka.client_kwargs())
    await admin.start()
    deadline = time.monotonic() + limit_s
    try:
        while True:
            committed = await admin.list_consumer_group_offsets(run.kafka.group_id, partitions=tps)
            ends = await run.consumer.end_offsets(tps)
            # A partition that never held a record has nothing to commit: "no offset" (-1) counts as 0.
            state = {tp.partition: [max(0, committed[tp].offset) if tp in committed else 0, ends[tp]] for tp in tps}
            if all(c == e for c, e in state.values()) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def run_phase(bootstrap: str, log_dir: Path, out_dir: Path, args: argparse.Namespace, threads: int,
                    name: str, factor: float | None, capacity: float | None) -> dict:
    """One phase on fresh topics and a fresh worker; returns its records, aggregates and time series."""
    run = await OverloadRun.start(bootstrap, log_dir, stream=False)
    run.start_worker({**kafka_env(run.kafka, threads), "WORKER_WORKER_ID": f"bench-overload-{name}"},
                     nice=0 if args.others_nice else None, cpus=args.worker_cpus)
    reader = asyncio.create_task(run.read_loop())
    rng = random.Random(f"{args.seed}-{name}")
    rate = None if factor is None else factor * capacity
    notes = []
    try:
        started = time.monotonic()
        await run.wait_for(run.ready.is_set, "worker ready (status with every partition assigned)", 300)
        ready_s = time.monotonic() - started
        async with LLMClient(run.kafka, backoff=BackoffPolicy(enabled=not args.no_backoff)) as client:
            run.t0_wall = time.time()
            if factor is None:  # a closed loop: priority 0, no deadline
                loop_end_s = await send_closed_loop(client, run, args.capacity_concurrency,
                                                    args.capacity_duration, rng)
                limit_s = 600.0
            else:
                await send_poisson(client, run, rate, args.duration, rng, timeouts(args))
                limit_s = max(timeouts(args).values()) + DRAIN_GRACE_S
            window_s = args.duration if factor is not None else None
            try:
                await run.wait_for(lambda: run.all_answered, "every final record", limit_s)
            except (RuntimeError, TimeoutError) as exc:
                notes.append(str(exc))
        await asyncio.sleep(LINGER_S)
        offsets = await offsets_vs_end(run, OFFSETS_WAIT_S)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        exit_code = await run.stop()
        shutil.copyfile(run.log_path, raw_dir(out_dir) / f"worker-{name}.log")
    requests = list(run.logs.values())
    statuses = [run.sample(s, cpu) for s, cpu in zip(run.raw_statuses, run.raw_cpu)]
    finals_at = [r.final.at_s for r in requests if outcome(r) in (IN_TIME, LATE)]
    end_s = max([window_s or 0.0] + [f.at_s for r in requests for f in r.finals])
    if factor is None:
        capacity = capacity_from_completions(finals_at, args.capacity_concurrency, loop_end_s)
        window_s = end_s
    summary = phase_summary(requests, window_s, capacity)
    # The engine over the span the phase's rate is measured on: the capacity loop's steady span, or an
    # overload phase's first completion to the end of its arrivals.
    steady = steady_span(finals_at, args.capacity_concurrency, loop_end_s) if factor is None else None
    span = steady[1:] if steady else (summary["goodput"]["first_completion_s"] or 0.0, window_s)
    summary["engine"] = engine_summary(statuses, *span)
    offsets_at_end = all(c == e for c, e in offsets.values())
    if exit_code != 0:
        notes.append(f"worker exited with {exit_code} on SIGTERM (log worker-{name}.log in the raw results)")
    return {"name": name, "factor": factor, "rate_per_s": rate, "capacity_per_s": capacity,
            "concurrency": args.capacity_concurrency if factor is None else None,
            "window_s": window_s, "worker_ready_s": ready_s, "worker_exit_code": exit_code, "notes": notes,
            "offsets": offsets, "offsets_at_end": offsets_at_end, "summary": summary,
            "floors": check_floors(name, factor, summary, offsets_at_end),
            "series": time_series(requests, statuses, run.kafka.num_priorities, end_s + 1),
            "requests": [asdict(r) for r in requests], "statuses": [asdict(s) for s in statuses]}


async def run_all(args: argparse.Namespace, threads: int, out_dir: Path) -> list[dict]:
    phases = []
    with kafka_session(args.bootstrap, prefix="bench-overload-") as session:
        capacity = args.capacity
        if capacity is None:
            phases.append(await run_phase(session.bootstrap, session.tmp, out_dir, args, threads, "capacity",
                                          None, None))
            capacity = phases[-1]["capacity_per_s"]
            print(render_phase(phases[-1]), flush=True)
            if not capacity:
                raise SystemExit("capacity could not be measured (fewer than 3 completions); see the worker log")
        for factor in args.factors:
            phases.append(await run_phase(session.bootstrap, session.tmp, out_dir, args, threads, f"{factor:g}x",
                                          factor, capacity))
            print(render_phase(phases[-1]), flush=True)
        if args.capacity is None and not args.no_capacity_after:
            phases.append(await run_phase(session.bootstrap, session.tmp, out_dir, args, threads,
                                          CAPACITY_AFTER, None, None))
            print(render_phase(phases[-1]), flush=True)
    return phases


CAPACITY_AFTER = "capacity-after"
"""The name of the second capacity phase, measured after the overload phases."""


def drift_rows(phases: list[dict]) -> list[list[str]]:
    """Per phase: its goodput (req/s) and tokens per busy second, and each as a share of both capacity phases'.
    Goodput ÷ capacity that follows the busy-second ratio says the machine's speed moved, not the scheduling."""
    before = next((p for p in phases if p["name"] == "capacity"), None)
    after = next((p for p in phases if p["name"] == CAPACITY_AFTER), None)
    if before is None or after is None:
        return []

    def speed(phase: dict) -> float | None:
        return (phase["summary"].get("engine") or {}).get("tokens_per_busy_s")

    def ratio(a, b) -> str:
        return _num(a / b if a is not None and b else None)

    rows = []
    for phase in phases:
        factor = phase["factor"]
        goodput = phase["capacity_per_s"] if factor is None else phase["summary"]["goodput"]["per_s"]
        rows.append([phase["name"], _num(goodput), ratio(goodput, before["capacity_per_s"]),
                     ratio(goodput, after["capacity_per_s"]),
                     ratio(goodput, (before["capacity_per_s"] + after["capacity_per_s"]) / 2),
                     _num(speed(phase), 0), ratio(speed(phase), speed(before)), ratio(speed(phase), speed(after))])
    return rows


# ---- report ------------------------------------------------------------------------------------------------


def _num(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def render_phase(phase: dict) -> str:
    """The phase's tables: outcomes per priority, goodput, wasted tokens, predicted vs actual, finals, offsets."""
    s, table = phase["summary"], phase["summary"]["table"]
    reasons = sorted({k for row in table.values() for k in row["rejected"]} - {"deadline", "shed"})
    errors = sorted({k for row in table.values() for k in row["error"]})
    rows = []
    for key, row in table.items():
        e2e = row["e2e_s"]
        rows.append([key, row["sent"], row["completed"],
                     f"{row[IN_TIME]} ({_num(100 * (row['in_time_fraction'] or 0), 1)} %)", row[LATE],
                     row["rejected"].get("deadline", 0), row["rejected"].get("shed", 0)]
                    + [row["rejected"].get(r, 0) for r in reasons] + [row["error"].get(e, 0) for e in errors]
                    + [row["missing"], " / ".join(_num(e2e[q]) for q in ("p50", "p90", "p99")),
                       f"{row['num_backed_off']} ({row['backoff_s_total']:.0f} s)"])
    header = (["priority", "sent", "completed", "completed within its deadline", "completed late",
               "rejected deadline", "rejected shed"] + [f"rejected {r}" for r in reasons]
              + [f"error {e}" for e in errors] + ["missing", "e2e p50 / p90 / p99 of completed (s)",
                                                   "held back by backoff"])
    if phase["factor"] is None:
        head = (f"## Capacity: {_num(phase['capacity_per_s'])} req/s\n\n{s['num_requests']} priority-0 requests "
                f"without deadline in a closed loop of {phase.get('concurrency')} outstanding; completions after the "
                f"first {phase.get('concurrency')} up to the end of sending / the time between them.")
    else:
        head = (f"## {phase['name']}: {_num(phase['rate_per_s'])} req/s offered for {phase['window_s']:g} s "
                f"({s['num_requests']} requests)")
    wasted = s["wasted_tokens"]
    lines = [head, "", *_table(header, rows), ""]
    if phase["factor"] is not None:
        gp = s["goodput"]
        lines += [f"Goodput {_num(gp['per_s'])} req/s completed within deadline = "
                  f"**{_num(s['goodput_over_capacity'], 3)} × capacity** (finals read from the first completion, "
                  f"at {_num(gp['first_completion_s'], 1)} s, to the end of arrivals; counting the drain too, "
                  f"{_num(gp['incl_drain_per_s'])} req/s over the {phase['window_s']:g} s window). Wasted tokens "
                  f"{wasted['wasted']} of {wasted['total']} = **{_num(100 * (wasted['fraction'] or 0), 1)} %**. "
                  f"Prompt tokens computed for requests that did not complete in time: "
                  f"{wasted.get('prompt_wasted', 0)} of {wasted.get('prompt_total', 0)} computed "
                  f"({_num(100 * (wasted.get('prompt_fraction') or 0), 1)} %).", ""]
        pred = [[key, v["queue"]["n"], _num(v["queue"]["p50"]), _num(v["queue"]["p90"]), v["e2e"]["n"],
                 _num(v["e2e"]["p50"]), _num(v["e2e"]["p90"])] for key, v in s["prediction_errors"].items()]
        lines += ["Predicted vs actual (completed requests that carry predictions; actual ÷ predicted):", ""]
        lines += _table(["priority", "queue n", "queue p50", "queue p90", "completion n", "completion p50",
                         "completion p90"], pred) if any(r[1] or r[4] for r in pred) else ["no predictions in the "
                                                                                           "final records"]
        lines.append("")
    engine = s.get("engine") or {}
    if engine.get("steps"):
        lines += [f"Engine over {engine['span_s']:.1f} s of the span measured above (from the status records): "
                  f"{engine['steps']} steps, {_num(engine['tokens_per_step'], 1)} tokens per step, "
                  f"{_num(engine['tokens_per_busy_s'], 0)} tokens per busy second, busy "
                  f"{_num(100 * engine['busy_fraction'], 0)} % of the time"
                  + (f"; the worker's engine thread used {_num(engine['engine_cpu_per_s'])} CPU s per s, its other "
                     f"threads (transport, Kafka I/O) {_num(engine['other_cpu_per_s'])}"
                     if engine.get("engine_cpu_per_s") is not None else "") + ".", ""]
    offsets = ", ".join(f"p{p}: {c}/{e}" for p, (c, e) in phase["offsets"].items())
    lines += [f"Finals: {s['num_missing']} missing, {s['num_duplicate_finals']} duplicate within an attempt, "
              f"{s['num_redelivered']} redelivered (higher attempt). Committed / log end per request partition: "
              f"{offsets}. Worker ready after {phase['worker_ready_s']:.1f} s, exit code "
              f"{phase['worker_exit_code']}."]
    lines += [f"Note: {n}" for n in phase["notes"]]
    if s["message_examples"]:
        lines += ["", "First message of each kind of refusal:", ""]
        lines += [f"- {kind}: {message or '(no message)'}" for kind, message in s["message_examples"].items()]
    return "\n".join(lines) + "\n"


def render_report(results: dict) -> str:
    env, cfg = results["environment"], results["config"]
    out = [f"# Overload control ({env['date']})", "",
           f"`{results['command']}`", "",
           f"One `llm-worker serve` per phase (default settings, {env['torch_threads']} torch thread(s)), "
           f"{env['num_cpus']} CPUs ({env.get('cpu_model', 'model not recorded')}) shared with the broker and "
           "this client"
           + (f" (they at niceness {env['others_nice']}, the worker at 0)" if env.get("others_nice") else "")
           + (f"; the worker pinned to CPU(s) {env['worker_cpus']}, the others to the rest"
              if env.get("worker_cpus") else "")
           + ". 1-min load average "
           f"{env['load_start'][0]:.2f} at the start, {env['load_end'][0]:.2f} at the end."
           + (" **The machine was busy at the start (load > 1.5): figures are slower and noisier.**"
              if env["load_start"][0] > 1.5 else ""), "",
           f"Workload: prompts of {PROMPT_WORDS[0]}-{PROMPT_WORDS[1]} words, max_new_tokens {MAX_NEW_TOKENS} "
           f"(ignore_eos), stream false; priorities 0/1/2 drawn "
           f"{'/'.join(f'{100 * w:g}' for w in cfg['priority_mix'].values())} %, timeout_ms "
           f"{'/'.join(f'{t:g}' for t in cfg['timeout_s'].values())} s; backoff {'on' if cfg['backoff'] else 'off'}; "
           f"seed {cfg['seed']}. Deadlines and "
           f"e2e count from the submit call. Worker settings from the environment: {cfg['worker_env'] or 'none'}."
           + (f" **Deadlines scaled × {cfg['deadline_scale']:g} (--deadline-scale): not the issue's workload.**"
              if cfg.get("deadline_scale", 1.0) != 1.0 else ""),
           "", f"Capacity: {results['capacity_per_s']:.2f} req/s ("
           + ("given with --capacity" if cfg["capacity_given"] else "measured below") + ").", ""]
    for phase in results["phases"]:
        out.append(render_phase(phase))
        if phase["factor"] is not None:
            out += [f"![timeline]({phase['timeline']})", ""]
    drift = drift_rows(results["phases"])
    if drift:
        out += ["## Drift: both capacities beside each phase", "",
                "Goodput of an overload phase (req/s completed within deadline; a capacity phase: its capacity) "
                "as a share of the capacity measured before the overload phases (what the floors use), after them, "
                "and of their mean; and the engine's tokens per busy second (status records) against the "
                "capacity phases'.", ""]
        out += _table(["phase", "goodput (req/s)", "÷ capacity before", "÷ capacity after", "÷ their mean",
                       "tokens / busy s", "÷ capacity before's", "÷ capacity after's"], drift)
        out.append("")
    out += ["## Floors", ""]
    out += _table(["check", "phase", "measured", "floor", "pass", "note"],
                  [[f["check"], f["phase"], f["value"] if not isinstance(f["value"], float) else f"{f['value']:.3f}",
                    f["floor"], "PASS" if f["pass"] else "FAIL", f["note"]] for f in results["floors"]])
    return "\n".join(out) + "\n"


def plot_timeline(phase: dict, capacity: float, path: Path) -> Path:
    """Stacked panels over the phase, 1-s bins: offered, admitted and goodput; late and rejected; queue and
    running; paused and shed, per priority."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def held(values: list) -> list[float]:
        """A bin without a status record (they come about once a second) shows the previous bin's value."""
        out, last = [], float("nan")
        for v in values:
            last = last if v is None else v
            out.append(last)
        return out

    ts, x = phase["series"], phase["series"]["bins_s"]
    colors = ["tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple"]
    fig, axes = plt.subplots(5, 1, figsize=(10, 13), sharex=True)
    num_p = len(ts["offered"])
    for p in range(num_p):
        c = colors[p % len(colors)]
        axes[0].plot(x, ts["offered"][p], color=c, label=f"offered p{p}")
        axes[0].plot(x, ts["admitted"][p], color=c, linestyle="--", label=f"admitted p{p}")
        axes[2].plot(x, ts[LATE][p], color=c, linestyle=":", label=f"late p{p}")
        for reason, style in (("shed", "-"), ("deadline", "--")):
            if reason in ts["rejected"]:
                axes[2].plot(x, ts["rejected"][reason][p], color=c, linestyle=style, label=f"{reason} p{p}")
        axes[3].plot(x, held(ts["queue"][p]), color=c, label=f"queue p{p}")
        for key, offset in (("paused", -0.15), ("shed", 0.15)):
            on = [i for i, v in enumerate(ts[key][p]) if v]
            axes[4].broken_barh([(i, 1) for i in on], (p + offset - 0.12, 0.24), color=c,
                                alpha=1.0 if key == "shed" else 0.45)
    axes[1].stackplot(x, *ts[IN_TIME], colors=colors[:num_p], labels=[f"in time p{p}" for p in range(num_p)])
    axes[3].plot(x, held(ts["running"]), color="black", linestyle="--", label="running")
    for ax in axes[:2]:
        ax.axhline(capacity, color="gray", linestyle=":", label="capacity")
    for ax in axes:
        ax.axvline(phase["window_s"], color="gray", linewidth=0.8)
    axes[0].set(ylabel="requests/s", title=f"{phase['name']}: offered (solid), admitted (dashed)")
    axes[1].set(ylabel="requests/s", title="goodput: completed within deadline, by priority")
    axes[2].set(ylabel="requests/s", title="rejected shed (solid), deadline (dashed); completed late (dotted)")
    axes[3].set(ylabel="requests", title="queue (lag + waiting) per priority; running")
    axes[4].set(ylabel="priority", xlabel="seconds since the first arrival (vertical line: arrivals end)",
                title="paused (light, upper) and shed (dark, lower) per priority", yticks=range(num_p),
                ylim=(num_p - 0.5, -0.5))
    for ax in axes[:4]:
        ax.legend(fontsize="x-small", ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- command line --------------------------------------------------------------------------------------------


def timeouts(args: argparse.Namespace) -> dict[int, float]:
    """Each priority's timeout in seconds: TIMEOUT_S times --deadline-scale."""
    return {p: t * args.deadline_scale for p, t in TIMEOUT_S.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", default="2,5", help="overload factors, comma-separated (default 2,5)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per factor (default 60; --quick 15)")
    parser.add_argument("--capacity-concurrency", type=int, default=CAPACITY_CONCURRENCY,
                        help=f"requests the capacity loop keeps outstanding (default {CAPACITY_CONCURRENCY})")
    parser.add_argument("--capacity-duration", type=float,
                        help="seconds the capacity loop sends (default 50; --quick 30)")
    parser.add_argument("--capacity", type=float, help="req/s: skip the capacity phases and use this")
    parser.add_argument("--no-capacity-after", action="store_true",
                        help="skip measuring capacity again after the overload phases")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a 30 s capacity loop, 15 s per factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-scale", type=float, default=1.0, metavar="S",
                        help="multiply every priority's timeout by S (default 1: the issue's 10/20/30 s). A machine "
                             "S times slower than one the workload was sized for sees the same deadlines in steps "
                             "with S; the floors are then checked on that workload, not the issue's")
    parser.add_argument("--no-backoff", action="store_true", help="the client ignores the workers' status")
    parser.add_argument("--threads", type=int, help="torch threads of the worker (default: settings.set_threads)")
    parser.add_argument("--bootstrap", help="use this broker instead of starting a local one")
    parser.add_argument("--others-nice", type=int, default=0, metavar="N",
                        help="run the broker and this load generator at niceness N and the worker at 0, as if "
                             "they had hosts of their own (default 0: all share the CPUs alike; lowering the "
                             "worker's niceness back needs root)")
    parser.add_argument("--worker-cpus", default="", metavar="LIST",
                        help="pin the worker to these CPUs (e.g. 1) and the broker and this client to the others, "
                             "as if each had a host of its own (default: no pinning)")
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    args.worker_cpus = {int(c) for c in args.worker_cpus.split(",") if c.strip()}
    args.factors = [float(f) for f in args.factors.split(",") if f.strip()]
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    args.capacity_duration = args.capacity_duration or (30.0 if args.quick else 50.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = list(os.getloadavg())
    if load_start[0] > 1.5:
        print(f"warning: 1-min load average {load_start[0]:.2f} at the start: the machine is busy, figures will be "
              "slower and noisier", file=sys.stderr)
    threads = set_threads(args.threads)
    if args.others_nice:
        os.nice(args.others_nice)  # the broker started below inherits it; the worker is set back to 0
    if args.worker_cpus:  # the broker started below inherits this process's CPUs; the worker gets its own
        others = set(range(os.cpu_count() or 1)) - args.worker_cpus
        if not others:
            raise SystemExit("--worker-cpus leaves no CPU for the broker and the client")
        os.sched_setaffinity(0, others)
    out_dir = args.out_dir or (REPO / "benchmarks" / "results"
                               / f"{time.strftime('%Y-%m-%d')}-overload-control{'-quick' if args.quick else ''}")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.bench_overload " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\ntorch threads {threads}; load {load_start[0]:.2f}; writing to {out_dir}", flush=True)
    phases = asyncio.run(run_all(args, threads, out_dir))
    capacity = args.capacity or phases[0]["capacity_per_s"]
    for phase in phases:
        if phase["factor"] is not None:
            phase["timeline"] = plot_timeline(phase, capacity, out_dir / f"timeline-{phase['name']}.png").name
    floors = [f for phase in phases for f in phase["floors"]]
    worker_env = {k: v for k, v in os.environ.items() if k.startswith(("ENGINE_", "WORKER_"))}
    results = {
        "command": command,
        "environment": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_model": cpu_model(),
                        "num_cpus": os.cpu_count(), "torch_threads": threads, "others_nice": args.others_nice,
                        "worker_cpus": sorted(args.worker_cpus), "load_start": load_start,
                        "load_end": list(os.getloadavg()), "python": sys.version.split()[0]},
        "config": {"factors": args.factors, "duration_s": args.duration,
                   "capacity_concurrency": args.capacity_concurrency, "capacity_duration_s": args.capacity_duration,
                   "capacity_given": args.capacity, "seed": args.seed, "backoff": not args.no_backoff,
                   "priority_mix": PRIORITY_MIX, "timeout_s": timeouts(args), "deadline_scale": args.deadline_scale,
                   "prompt_words": PROMPT_WORDS, "max_new_tokens": MAX_NEW_TOKENS, "worker_env": worker_env},
        "capacity_per_s": capacity, "phases": phases, "floors": floors,
        "all_pass": all(f["pass"] for f in floors),
    }
    summary = {**results, "phases": [{k: v for k, v in phase.items() if k not in PER_REQUEST_KEYS}
                                     for phase in phases]}
    write_results(out_dir, results, summary, indent=1, default=str)
    (out_dir / "report.md").write_text(render_report(results))
    for f in floors:
        value = f"{f['value']:.3f}" if isinstance(f["value"], float) else f["value"]
        print(f"{'PASS' if f['pass'] else 'FAIL'}  {f['phase']:>8}  {f['check']}: {value} (floor {f['floor']})")
    print(f"written to {out_dir}")
    return 0 if results["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
