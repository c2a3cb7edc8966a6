"""The whole worker on the simulated GPU (issue #16): the Kafka path against the engine alone and the forward.

Each point (model shape, requests running at once) replays one offline trace (every request at t=0; prompts of
96-160 token ids from SmolLM2's ordinary range, 192-320 output tokens with ignore_eos, stream=true) three ways,
all on `ENGINE_DEVICE=sim:h200` (worker/model/sim.py) with the same EngineSettings:

(a) forward-only ceiling: the trace's output tokens / the sum of the simulated step times of run (b): what the
    device would give if nothing around the forward took any time;
(b) engine alone: LLMEngine in this process, driven through the Engine contract as the worker's engine thread
    drives it (`bench_engine.run_engine`); token times from the engine's outputs;
(c) Kafka path: a LocalBroker, fresh topics, an `llm-worker serve` subprocess with the same ENGINE_* settings
    (and WORKER_CHUNK_INTERVAL_MS per run), requests sent once it has joined and served a warm-up; token times
    from the client's stream chunks (when the batch holding the chunk was read), counted from the first send.

Reported per run: output tok/s, (b)/(a) and (c)/(b), TTFT, per-token ITL and chunk-gap p50/p90/p99
(benchmarks/lib/token_times.py), and for (c) the result records/s the client received (chunks + finals), which
is what the worker's publisher sustained. Floor: (c) >= 0.85 x (b) at 256 running on the 8B shape, with the
default chunk interval. The broker's JVM, the client and the worker share this machine's CPUs.

    .venv/bin/python -m benchmarks.bench_sim_kafka                          # ~3 min, results/<date>-sim-kafka/
    .venv/bin/python -m benchmarks.bench_sim_kafka --points llama-3.1-8b@256 --chunk-intervals 0,20 --py-spy gil
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_engine import run_engine
from benchmarks.bench_kafka_path import NO_SHEDDING, KafkaRun, kafka_env, kafka_session, warmup_trace
from benchmarks.lib.run_result import compute_metrics
from benchmarks.lib.results_store import raw_dir, write_results
from benchmarks.lib.settings import DEFAULT_MODEL, min_token_id, set_threads
from benchmarks.lib.token_times import TokenTimes
from benchmarks.lib.trace import Trace, TraceConfig, TraceRequest
from schemas.result import StreamChunk
from worker.model.settings import EngineSettings
from worker.worker_settings import WorkerSettings
from worker.engine.engine import LLMEngine
from worker.model.pull import resolve_model
from worker.model.sim import SimRunner

REPO = Path(__file__).resolve().parents[1]
SIM_FLOOR = 0.85
"""Kafka path / engine alone output tok/s at FLOOR_POINT (issue #16)."""
FLOOR_POINT = "llama-3.1-8b@256"
DEFAULT_POINTS = "llama-3.1-8b@64,llama-3.1-8b@256,smollm2-135m@256"
DEFAULT_CHUNK_INTERVAL_MS = WorkerSettings.model_fields["chunk_interval_ms"].default
PROMPT_LEN = (96, 160)
OUTPUT_LEN = (192, 320)
"""Mixed lengths keep the batch full: a request that finishes frees a seat for a waiting one at once."""


# ---- pure helpers (unit-tested) ---------------------------------------------------------------------------


def parse_point(point: str) -> tuple[str, int]:
    """"llama-3.1-8b@256" -> ("llama-3.1-8b", 256)."""
    model, _, running = point.rpartition("@")
    if not model or not running.isdigit() or int(running) < 1:
        raise ValueError(f"a point is <sim model>@<running>, e.g. llama-3.1-8b@256; got {point!r}")
    return model, int(running)


def sim_trace(num_requests: int, seed: int, low: int, vocab_size: int) -> Trace:
    """Every request at t=0, priority 1, lengths drawn uniformly from PROMPT_LEN and OUTPUT_LEN."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(low, vocab_size) for _ in range(rng.randint(*PROMPT_LEN))]
        requests.append(TraceRequest(f"r{i:05d}", 0.0, prompt, rng.randint(*OUTPUT_LEN), 1, "sim"))
    return Trace(TraceConfig(rate=math.inf, num_requests=num_requests, profile="sim", seed=seed,
                             min_token_id=low, vocab_size=vocab_size), requests)


def sim_settings(sim_model: str, max_num_seqs: int, max_num_batched_tokens: int, device: str,
                 async_scheduling: str = "auto") -> EngineSettings:
    """What a GPU deployment of the continuous engine would set; prefix caching off (random prompts)."""
    return EngineSettings(
        model=str(resolve_model(DEFAULT_MODEL)), device=device, sim_model=sim_model, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=PROMPT_LEN[1] + OUTPUT_LEN[1] + 32,
        enable_prefix_caching=False, policy="continuous", async_scheduling=async_scheduling,
    )


def settings_env(settings: EngineSettings, chunk_interval_ms: float) -> dict[str, str]:
    """ENGINE_* and WORKER_* variables that make `llm-worker serve` run `settings` (shedding off)."""
    return {
        "ENGINE_MODEL": settings.model, "ENGINE_DEVICE": settings.device, "ENGINE_SIM_MODEL": settings.sim_model,
        "ENGINE_POLICY": settings.policy, "ENGINE_MAX_NUM_SEQS": str(settings.max_num_seqs),
        "ENGINE_MAX_NUM_BATCHED_TOKENS": str(settings.max_num_batched_tokens),
        "ENGINE_MAX_MODEL_LEN": str(settings.max_model_len), "ENGINE_BLOCK_SIZE": str(settings.block_size),
        "ENGINE_ENABLE_PREFIX_CACHING": "false", "ENGINE_SIM_LOGITS_WIDTH": str(settings.sim_logits_width),
        "ENGINE_ASYNC_SCHEDULING": settings.async_scheduling,
        "WORKER_CHUNK_INTERVAL_MS": str(chunk_interval_ms), "WORKER_MAX_QUEUE_TIME_S": NO_SHEDDING,
        "WORKER_WORKER_ID": "bench-sim-kafka",
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent not idle so far, all cores (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def broker_pid(data_dir: Path) -> int | None:
    """The JVM whose command line names the session's folder (the LocalBroker kafka_session started)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(data_dir).encode() in cmdline.read_bytes():
                return int(cmdline.parent.name)
        except OSError:
            continue
    return None


class CpuMeter:
    """CPU seconds of the worker, the broker, this process (the client) and the whole machine over a span."""

    def __init__(self, worker_pid: int, broker: int | None) -> None:
        self.pids = {"worker": worker_pid, "broker": broker, "client": os.getpid()}
        self.start = self._read()
        self.t0 = time.monotonic()

    def _read(self) -> dict[str, float]:
        out = {name: process_cpu_s(pid) if pid else math.nan for name, pid in self.pids.items()}
        out["machine"] = machine_busy_s()
        return out

    def stop(self) -> dict[str, float]:
        """CPU cores each used on average over the span (machine: of os.cpu_count())."""
        end, wall = self._read(), time.monotonic() - self.t0
        return {f"cpu_{name}": (end[name] - self.start[name]) / wall for name in end}


# ---- (a) and (b): the engine alone ------------------------------------------------------------------------


class _TimedEngine:
    """An LLMEngine whose step() outputs are logged as token deliveries; everything else passes through."""

    def __init__(self, engine: LLMEngine, times: TokenTimes) -> None:
        self._engine = engine
        self.times = times
        self.start = time.monotonic()

    def step(self):
        outputs = self._engine.step()
        now = time.monotonic() - self.start
        for out in outputs:
            self.times.add(out.request_id, now, len(out.new_token_ids))
        return outputs

    def __getattr__(self, name):
        return getattr(self._engine, name)


def run_engine_alone(settings: EngineSettings, trace: Trace, warmup: Trace) -> dict:
    runner = SimRunner(settings)
    run_engine(LLMEngine(settings, runner=runner), warmup, "warm-up")
    runner.reset()
    times = TokenTimes()
    engine = _TimedEngine(LLMEngine(settings, runner=runner), times)
    simulated_before = runner.simulated_s
    meter = CpuMeter(os.getpid(), None)
    run = run_engine(engine, trace, "engine")
    cpu = meter.stop()
    simulated_s = runner.simulated_s - simulated_before
    m = compute_metrics(run)
    tokens = sum(r.num_output_tokens for r in run.records if r.error is None)
    return {"system": "engine", "wall_s": m["wall_s"], "num_completed": m["num_completed"],
            "num_requests": m["num_requests"], "output_tokens": tokens, "output_tokens_per_s": m["output_tokens_per_s"],
            "simulated_s": simulated_s, "ceiling_tokens_per_s": tokens / simulated_s if simulated_s else math.nan,
            "num_steps": m["num_steps"], "max_concurrent": m["max_concurrent"], "cpu_client": cpu["cpu_client"],
            "cpu_machine": cpu["cpu_machine"], **times.summary()}


# ---- (c): the Kafka path ----------------------------------------------------------------------------------


class _TimedKafkaRun(KafkaRun):
    """KafkaRun that also logs every chunk of the awaited trace as a token delivery and counts its records."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.times = TokenTimes()
        self.num_records = 0
        self.worker_e2e_ms: list[float] = []
        """The finals' e2e_ms: record timestamp (the send, on this machine's clock) to the worker's final."""

    def start_worker_with_switch_interval(self, env: dict[str, str], switch_interval_ms: float | None) -> None:
        """`llm-worker serve`, with sys.setswitchinterval first when asked (Python's default is 5 ms: a thread
        that wants the GIL, as the engine thread does when a step's device wait ends, waits up to that long
        for a thread running pure Python, as the asyncio loop does, to let go of it)."""
        if switch_interval_ms is None:
            self.start_worker(env)
            return
        code = (f"import sys; sys.setswitchinterval({switch_interval_ms / 1e3!r}); from worker.cli import main; "
                "sys.argv = ['llm-worker', 'serve']; sys.exit(main())")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=self.log, stderr=self.log,
                                     env=env)

    def on_result(self, record, now: float) -> None:
        super().on_result(record, now)
        tracker = self.tracker
        if tracker is None or record.id not in tracker.records:
            return
        self.num_records += 1
        if isinstance(record, StreamChunk):
            self.times.add(record.id, now - self.t0, len(record.token_ids))
        elif record.timings.e2e_ms is not None:
            self.worker_e2e_ms.append(record.timings.e2e_ms)


async def run_kafka_sim(bootstrap: str, settings: EngineSettings, trace: Trace, warmup: Trace,
                        chunk_interval_ms: float, log_dir: Path, py_spy_out: Path | None, timeout_s: float,
                        switch_interval_ms: float | None = None) -> dict:
    run = await _TimedKafkaRun.start(bootstrap, log_dir, stream=True)
    env = kafka_env(run.kafka, threads=1)
    env.pop("ENGINE_NUM_KV_BLOCKS", None)
    env.update(settings_env(settings, chunk_interval_ms))
    run.start_worker_with_switch_interval(env, switch_interval_ms)
    reader = asyncio.create_task(run.read_loop())
    spy = None
    try:
        started = time.monotonic()
        await run.wait_for(run.ready.is_set, "worker ready (status with every partition assigned)", 300)
        ready_s = time.monotonic() - started
        await run.replay(warmup, "warm-up finals", 120)
        run.times, run.num_records, run.worker_e2e_ms = TokenTimes(), 0, []
        if py_spy_out is not None:
            spy = subprocess.Popen([str(REPO / ".venv/bin/py-spy"), "record", "-p", str(run.proc.pid), "-r", "200",
                                    "--threads", "--nonblocking", "--format", "raw", "-o", str(py_spy_out)]
                                   + (["--gil"] if py_spy_out.name.startswith("pyspy-gil") else []),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        meter = CpuMeter(run.proc.pid, broker_pid(log_dir))
        tracker = await run.replay(trace, "every final record", timeout_s)
        cpu = meter.stop()
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            await asyncio.to_thread(spy.wait, 30)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        exit_code = await run.stop()
    done = [r for r in tracker.records.values() if r.finish_s is not None and r.error is None]
    tokens = sum(r.num_output_tokens for r in done)
    wall = tracker.last_final_s
    worker_wall = max(run.worker_e2e_ms, default=math.nan) / 1e3
    return {"system": "kafka", "chunk_interval_ms": chunk_interval_ms, "switch_interval_ms": switch_interval_ms,
            "wall_s": wall, "num_completed": len(done),
            "num_requests": len(tracker.records), "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "num_records": run.num_records, "records_per_s": run.num_records / wall, "worker_ready_s": ready_s,
            "worker_wall_s": worker_wall, "worker_tokens_per_s": tokens / worker_wall,
            "worker_exit_code": exit_code, **cpu, **run.times.summary()}


# ---- driver -----------------------------------------------------------------------------------------------


def run_point(point: str, args: argparse.Namespace, session, low: int, vocab_size: int, warmup: Trace,
              out_dir: Path) -> list[dict]:
    model, running = parse_point(point)
    settings = sim_settings(model, running, args.max_num_batched_tokens, args.device, args.async_scheduling)
    trace = sim_trace(args.requests_per_seat * running, args.seed, low, vocab_size)
    rows = []
    for rep in range(args.reps):
        # The engine alone first on even repetitions, last on odd ones (ABBA): drift in the machine's load then
        # weighs on both sides alike.
        runs: list = ["engine"] + args.chunk_intervals
        if rep % 2:
            runs.reverse()
        done = []
        for what in runs:
            if what == "engine":
                row = run_engine_alone(settings, trace, warmup)
            else:
                spy = raw_dir(out_dir) / f"pyspy-{args.py_spy}-{point}-{what:g}ms-rep{rep}.txt" if args.py_spy else None
                row = asyncio.run(run_kafka_sim(session.bootstrap, settings, trace, warmup, what, session.tmp,
                                                spy, args.timeout_s, args.switch_interval_ms))
            row.update(point=point, rep=rep, load_at_end=os.getloadavg()[0], num_requests=len(trace.requests))
            done.append(row)
        engine = next(r for r in done if r["system"] == "engine")
        for row in sorted(done, key=lambda r: r["system"] != "engine"):
            row["vs_ceiling"] = row["output_tokens_per_s"] / engine["ceiling_tokens_per_s"]
            row["vs_engine"] = row["output_tokens_per_s"] / engine["output_tokens_per_s"]
            print(table_line(row), flush=True)
            rows.append(row)
    return rows


def floor_verdict(rows: list[dict], default_interval: float) -> dict:
    """The median over repetitions of Kafka / engine alone (each against its own repetition's engine run)."""
    ratios = [r["vs_engine"] for r in rows if r["point"] == FLOOR_POINT and r["system"] == "kafka"
              and r["chunk_interval_ms"] == default_interval]
    if not ratios:
        return {"floor": SIM_FLOOR, "point": FLOOR_POINT, "value": None, "meets_floor": False}
    value = statistics.median(ratios)
    return {"floor": SIM_FLOOR, "point": FLOOR_POINT, "chunk_interval_ms": default_interval, "value": value,
            "per_rep": ratios, "meets_floor": bool(value >= SIM_FLOOR)}


HEAD = ("| point | rep | system | chunk ms | done | wall s | out tok/s | worker tok/s | / ceiling | / engine | "
        "records/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | chunk gap p50/p99 ms | load 1m | "
        "cores: worker/broker/client/machine |")


def table_line(r: dict) -> str:
    chunk = f"{r['chunk_interval_ms']:g}" if r["system"] == "kafka" else "-"
    records = f"{r['records_per_s']:.0f}" if r["system"] == "kafka" else "-"
    system = "engine" if r["system"] == "engine" else "kafka"
    ceiling = f" (ceiling {r['ceiling_tokens_per_s']:.0f})" if r["system"] == "engine" else ""
    worker = f"{r['worker_tokens_per_s']:.0f}" if r["system"] == "kafka" else "-"
    cores = "/".join(f"{r[k]:.2f}" for k in ("cpu_worker", "cpu_broker", "cpu_client", "cpu_machine")) \
        if r["system"] == "kafka" else f"-/-/{r['cpu_client']:.2f}/{r['cpu_machine']:.2f}"
    return (f"| {r['point']} | {r['rep']} | {system}{ceiling} | {chunk} | {r['num_completed']}/{r['num_requests']} | "
            f"{r['wall_s']:.2f} | {r['output_tokens_per_s']:.0f} | {worker} | {r['vs_ceiling']:.3f} | "
            f"{r['vs_engine']:.3f} | "
            f"{records} | {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} | "
            f"{r['itl_p50_ms']:.2f}/{r['itl_p90_ms']:.2f}/{r['itl_p99_ms']:.2f} | "
            f"{r['gap_p50_ms']:.1f}/{r['gap_p99_ms']:.1f} | {r['load_at_end']:.2f} | {cores} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated <sim model>@<running>")
    parser.add_argument("--device", default="sim:h200", choices=["sim:h200", "sim:h100"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--requests-per-seat", type=int, default=2,
                        help="requests per max_num_seqs seat (2: the batch refills once)")
    parser.add_argument("--chunk-intervals", default=f"{DEFAULT_CHUNK_INTERVAL_MS:g},50,20,0",
                        help="WORKER_CHUNK_INTERVAL_MS of each Kafka run of a point; the first is the floor's "
                             "(default: the worker's default first)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of each point, in ABBA order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="ENGINE_ASYNC_SCHEDULING of the engine and the worker (auto: on, as on a GPU)")
    parser.add_argument("--py-spy", choices=["active", "gil"],
                        help="record each Kafka run's worker with py-spy (raw stacks per thread, 200 Hz) into the "
                             "run's raw folder: active threads, or only the thread holding the GIL")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="start the worker with sys.setswitchinterval(this); default: Python's (5 ms)")
    parser.add_argument("--bootstrap", help="use this broker instead of starting a local one")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    args.points = [p for p in args.points.split(",") if p]
    for p in args.points:
        parse_point(p)
    args.chunk_intervals = [float(x) for x in args.chunk_intervals.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = list(os.getloadavg())
    set_threads(1)  # the simulated forward uses no torch threads; the sampler's few ops run on one
    out_dir = args.out_dir or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-sim-kafka"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"load {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; {os.cpu_count()} CPUs", flush=True)
    tokenizer = SimRunner(sim_settings("smollm2-135m", 1, 8, args.device)).tokenizer
    low, vocab_size = min_token_id(tokenizer), len(tokenizer)
    warmup = warmup_trace(low, vocab_size)
    started = time.monotonic()
    print(HEAD, flush=True)
    rows: list[dict] = []
    with kafka_session(args.bootstrap, prefix="bench-sim-kafka-") as session:
        for point in args.points:
            rows += run_point(point, args, session, low, vocab_size, warmup, out_dir)
    verdict = floor_verdict(rows, args.chunk_intervals[0])
    result = {"environment": {"num_cpus": os.cpu_count(), "load_before": load_before,
                              "load_after": list(os.getloadavg()), "python": sys.version.split()[0],
                              "minutes": (time.monotonic() - started) / 60},
              "config": {**{k: v for k, v in vars(args).items() if k != "out_dir"},
                         "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN},
              "floor": verdict, "runs": rows}
    write_results(out_dir, result, result, indent=1, default=str)  # per-run aggregates: all of it is summary
    write_report(out_dir, argv, rows, verdict, load_before, args.requests_per_seat)
    print(f"written to {out_dir}")
    return 0 if verdict["meets_floor"] else 1


def write_report(out_dir: Path, argv: list[str] | None, rows: list[dict], verdict: dict,
                 load_before: list[float], requests_per_seat: int) -> None:
    value = "no run" if verdict["value"] is None else f"{verdict['value']:.3f}"
    summary = (f"Floor: Kafka path / engine alone at {FLOOR_POINT}, chunk interval "
               f"{verdict.get('chunk_interval_ms', '-')} ms: **{value}** "
               f"({'meets' if verdict['meets_floor'] else 'BELOW'} {SIM_FLOOR}).")
    (out_dir / "report.md").write_text(
        f"# Kafka path on the simulated GPU ({time.strftime('%Y-%m-%dT%H:%M:%S')})\n\n"
        f"Offline traces (all at t=0, {requests_per_seat} x max_num_seqs requests), prompts "
        f"{PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, outputs {OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} (ignore_eos), stream=true. "
        f"{os.cpu_count()} CPUs; 1-min load {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after. "
        f"`/ ceiling`: output tok/s over the forward-only ceiling (output tokens / simulated device seconds of the "
        f"engine-alone run); `/ engine`: over the engine alone. ITL per token; chunk gap: between a request's "
        f"deliveries. Kafka times are the client's.\n\n"
        f"{HEAD}\n|{'---|' * 16}\n" + "\n".join(table_line(r) for r in rows) + f"\n\n{summary}\n\n"
        f"`.venv/bin/python -m benchmarks.bench_sim_kafka {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(summary)


if __name__ == "__main__":
    raise SystemExit(main())
