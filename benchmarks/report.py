"""`make bench`: sweep arrival rates for every system on one trace per rate, repeat, and write a report.

    python -m benchmarks.report                 # full sweep (~110 min on an idle 2-core CPU)
    python -m benchmarks.report --quick         # smoke run, a few minutes
    python -m benchmarks.report --systems continuous,static --rates 0.5,1,0 --reps 3

Systems (default: all): the engine's policies `continuous`, `dynamic`, `static` (benchmarks/bench_engine.py),
transformers' `hf-static` and `hf-cb` (benchmarks/lib/hf_systems.py), and `kafka`: the continuous policy behind
the whole Kafka path (producer -> request topic -> `llm-worker serve` -> result topic, benchmarks/
bench_kafka_path.py). With kafka in the list one LocalBroker (temporary folder) runs for the whole sweep, from
before the warm-up to the end, and is stopped on every exit, Ctrl-C included; each Kafka run starts fresh
topics and one worker subprocess with the in-process engine's settings and torch threads, which serves a
2-request warm-up before the trace is sent. A failed Kafka run (worker exit, timeout) ends the Kafka runs
but not the sweep: it is noted in the report and the broker data and worker logs are kept (the note says
where); after a clean sweep the folder is removed.

Without --rates the sweep is calibrated on this machine: the continuous engine's offline throughput C
(requests/s, all requests at t=0) is measured once, and the rates are 0.5·C, 1.0·C and 2.0·C (light load, at
and beyond saturation), then the saturation point itself: offline, every request at t=0; --quick uses 0.7·C and
offline; --factors chooses others (0 = offline). Every system sees the same trace at a rate; repetitions replay
it again (systems interleaved, so drift in machine load spreads over all of them). Writes
benchmarks/results/<date>[-quick]/{summary.json, report.md, *.png} and, git-ignored,
benchmarks/results/raw/<date>[-quick]/{results.json, traces/} (benchmarks/lib/results_store.py).

The offline point's trace holds --offline-requests requests (default 48), more than the rated traces: with
20 requests at t=0 the run's length is mostly the drain of its three or four long requests running nearly
alone, which measures their latency, not the throughput a system sustains with a queue. hf-static sits the
offline point out unless --offline-systems names it (6 min per repetition there, and no floor reads it).

Floors (benchmarks/lib/floors.py): continuous vs static at every rate (2x output tok/s, 1/3 of the short e2e
p99) and, in issue #7's form, continuous's sustained output tok/s (its own p99 under 10 s) >= 2x static's at the
highest rate where static's p99 e2e stays under 10 s (all requests, and short requests alone); continuous vs
hf-cb 1.5x output tok/s at saturation (the highest rate both ran: the offline point); kafka vs continuous 0.90x
output tok/s at every rate (issue #5); paged KV >= 3x the requests of max-length contiguous reservation in the
same budget; engine overhead at most 10%. `--rerender DIR` recomputes floors, report.md and plots from DIR's results.

The time estimate (20 requests of the cpu profile, 3 rates, 6 systems, 3 repetitions: 76 min measured; the
48-request offline point, 5 systems, 3 repetitions: ~20-25 min) comes from per-run wall times measured on a
2-core EPYC; the Kafka runs cost about one more system's trace time plus ~10-20 s per run to start a worker
and warm it up. On a machine shared with
other work (load above the core count) expect it to take longer; --num-requests, --factors and --systems cut
it down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_engine import format_run, kv_capacity, measure_overhead, run_engine_policy
from benchmarks.bench_kafka_path import kafka_session, run_kafka, warmup_trace
from benchmarks.lib.floors import check_floors
from benchmarks.lib.hf_systems import HFBaselines
from benchmarks.lib.render import rate_label, render_markdown, render_plots
from benchmarks.lib.results_store import raw_dir, read_results, write_results
from benchmarks.lib.run_result import compute_metrics
from benchmarks.lib.settings import (ALL_SYSTEMS, BLOCK_SIZE, DEFAULT_MODEL, ENGINE_POLICIES, HF_SYSTEMS,
                                     KV_CACHE_BYTES, MAX_BATCH_SIZE, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, load_runner,
                                     min_token_id, cpu_model, set_threads)
from benchmarks.lib.stats import median_min_max
from benchmarks.lib.trace import Trace, TraceConfig, generate_trace, is_offline
from worker.model.runner import ModelRunner

RESULTS_DIR = Path(__file__).parent / "results"
"""Where a sweep writes, in a folder named after the date, unless --out-dir names another."""
SHARED_NOTE = "The machine was shared with other processes: figures are noisy and slower than on an idle machine. "
DEFAULT_SYSTEMS = ALL_SYSTEMS + ("kafka",)
"""What `make bench` measures: the engine policies, transformers' baselines and the Kafka path."""
OFFLINE_REQUESTS = 48
"""Requests in the offline (saturation) point's trace; see the module docstring."""
OFFLINE_SKIPS = ("hf-static",)
"""Systems that sit the offline point out by default."""
SUMMARY_KEYS = ("output_tokens_per_s", "requests_per_s", "kv_utilisation_mean", "kv_pool_usage_max",
                "max_concurrent", "num_completed")


def environment(threads: int) -> dict:
    import torch
    import transformers

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(), "num_cpus": os.cpu_count(), "torch_threads": threads,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "load_before": list(os.getloadavg()),
    }


def flatten(metrics: dict) -> dict:
    """One run's metrics as flat keys (short_e2e_p99, ...) for aggregation across repetitions."""
    flat = {key: metrics[key] for key in SUMMARY_KEYS}
    for kind, by_metric in metrics["latency"].items():
        for name, summary in by_metric.items():
            for q in ("p50", "p95", "p99"):
                flat[f"{kind}_{name}_{q}"] = summary[q]
    return flat


def summarize(runs: list[dict]) -> dict:
    flats = [flatten(m) for m in runs]
    return {key: median_min_max([f.get(key, math.nan) for f in flats]) for key in flats[0]}


def parse_systems(text: str) -> list[str]:
    """`--systems`: comma-separated names from DEFAULT_SYSTEMS, in the order given; ValueError for others."""
    systems = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = set(systems) - set(DEFAULT_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {DEFAULT_SYSTEMS}")
    return systems


def kafka_timeout_s(trace: Trace, walls: Sequence[float] = ()) -> float:
    """How long a Kafka run may take to deliver every final record: 10x the longest it should take (the trace's
    arrival span, or the longest wall time of any run of this trace so far), and at least 300 s."""
    return max(300.0, 10 * max([trace.duration_s, *walls]))


def offline_systems(systems: list[str], named: str | None) -> list[str]:
    """Who runs the offline point: the systems named (each must be in the sweep), else the sweep's systems
    less OFFLINE_SKIPS."""
    if named is None:
        return [s for s in systems if s not in OFFLINE_SKIPS]
    chosen = parse_systems(named)
    if stray := [s for s in chosen if s not in systems]:
        raise ValueError(f"--offline-systems {','.join(stray)} not in --systems")
    return [s for s in systems if s in chosen]


# ---- the sweep ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the defaults that depend on --quick filled in and --systems / --offline-systems
    parsed into lists (the systems of the sweep, and those that run the offline point)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny lengths, few requests, 1 repetition")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, from {','.join(DEFAULT_SYSTEMS)} (default: all)")
    parser.add_argument("--rates", help="comma-separated req/s; 0 = offline. Default: calibrated (see above)")
    parser.add_argument("--factors", help="calibrated rates as multiples of C, 0 = offline "
                        "(default 0.5,1,2; 0.7,0 with --quick)")
    parser.add_argument("--reps", type=int, help="repetitions per point (default 3; 1 with --quick)")
    parser.add_argument("--num-requests", type=int, help="requests per trace (default 20; 6 with --quick)")
    parser.add_argument("--offline-requests", type=int,
                        help=f"requests in the offline point's trace (default {OFFLINE_REQUESTS}; "
                             "--num-requests with --quick)")
    parser.add_argument("--offline-systems",
                        help="comma-separated systems that run the offline point (default: --systems less "
                             f"{','.join(OFFLINE_SKIPS)})")
    parser.add_argument("--profile", help="trace length profile (default cpu; tiny with --quick)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: see settings.set_threads)")
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--rerender", type=Path, metavar="RESULTS_DIR",
                        help="measure nothing: recompute the floors, report.md and plots from RESULTS_DIR's results")
    args = parser.parse_args(argv)
    if args.rerender:
        return args
    args.reps = args.reps or (1 if args.quick else 3)
    args.num_requests = args.num_requests or (6 if args.quick else 20)
    args.offline_requests = args.offline_requests or (args.num_requests if args.quick else OFFLINE_REQUESTS)
    args.profile = args.profile or ("tiny" if args.quick else "cpu")
    try:
        args.systems = parse_systems(args.systems)
        args.offline_systems = offline_systems(args.systems, args.offline_systems)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)
    out_dir = args.out_dir or RESULTS_DIR / (datetime.date.today().isoformat() + ("-quick" if args.quick else ""))
    traces_dir = raw_dir(out_dir) / "traces"
    traces_dir.mkdir(parents=True, exist_ok=True)
    threads = set_threads(args.threads)
    env = environment(threads)
    say(f"torch threads {threads}; load {env['load_before'][0]:.2f}; writing to {out_dir}")
    sweep = Sweep(args, threads, load_runner(args.model, args.profile))
    # One broker for the whole sweep, started before the warm-up so that every measured run (calibration
    # included) shares the machine with it; stopped on every exit, Ctrl-C included (kafka_session).
    with kafka_session(prefix="bench-report-") if "kafka" in args.systems else contextlib.nullcontext() as kafka:
        sweep.kafka = kafka
        if kafka is not None:
            say(f"Kafka broker at {kafka.bootstrap}; broker data and worker logs in {kafka.tmp}")
        sweep.warm_up()
        rates, calibration = sweep.choose_rates()
        traces = {rate: sweep.trace_at(rate) for rate in rates}
        for rate, trace in traces.items():
            trace.save(traces_dir / f"rate_{rate:g}.json")
        sweep.run_repetitions(rates, traces)
    if not sweep.kafka_failed:  # the logs went with the temporary folder
        for ms in sweep.runs.values():
            for m in ms:
                m.pop("worker_log", None)
    overhead_runs = ([measure_overhead(sweep.runner, num_steps=4 if args.quick else 16) for _ in range(args.reps)]
                     if "continuous" in args.systems else [])
    overhead = summarize_overhead(overhead_runs)
    env["load_after"] = list(os.getloadavg())
    results = {
        "environment": env,
        "config": sweep_config(args, rates, sweep.runner.max_model_len),
        "calibration": calibration,
        "noise_note": noise_note(env, sweep.runs, args.reps),
        "points": [{"system": s, "rate": None if is_offline(r) else r, "summary": summarize(ms), "runs": ms}
                   for (s, r), ms in sweep.runs.items()],
        "kv_capacity": kv_capacity(sweep.runner, traces[rates[0]], sweep.max_concurrent()),
        "overhead": overhead,
        "overhead_runs": overhead_runs,
        "notes": sweep.notes,
    }
    write_report(results, out_dir)
    return 0


class Sweep:
    """Runs the systems on traces and keeps what they measured: the metrics of every run by (system, rate),
    and the notes for the report."""

    def __init__(self, args: argparse.Namespace, threads: int, runner: ModelRunner) -> None:
        self.args = args
        self.threads = threads
        self.runner = runner
        self.hf = HFBaselines(runner.model_path) if any(s in HF_SYSTEMS for s in args.systems) else None
        self.min_token_id = min_token_id(runner.tokenizer)
        self.kafka_warmup = warmup_trace(self.min_token_id, runner.vocab_size)
        self.kafka = None
        """The KafkaSession while the sweep runs kafka, else None."""
        self.kafka_failed = False
        """Set by the first failed Kafka run: no Kafka run follows it."""
        self.runs: dict[tuple[str, float], list[dict]] = {}
        self.notes: list[str] = []
        if "kafka" in args.systems:
            self.notes.append(
                "kafka: the continuous policy behind the whole Kafka path: a LocalBroker started once for the "
                "sweep, and per run fresh topics and one `llm-worker serve` subprocess with the same engine "
                "settings and torch threads, shedding off, which joins its group and serves a 2-request "
                "warm-up before the trace is sent; latencies are read on the client (TTFT = first stream "
                "chunk); KV columns are not sampled. The broker, client and worker share the CPUs.")

    def trace_at(self, rate: float, size: int | None = None) -> Trace:
        """The sweep's trace at `rate`: --offline-requests requests offline, else --num-requests (or `size`)."""
        if size is None:
            size = self.args.offline_requests if is_offline(rate) else self.args.num_requests
        return generate_trace(TraceConfig(rate=rate, num_requests=size, profile=self.args.profile,
                                          seed=self.args.seed, min_token_id=self.min_token_id,
                                          vocab_size=self.runner.vocab_size))

    def run(self, system: str, trace: Trace) -> dict:
        """One replay of `trace` on `system`: its metrics, with the 1-minute load at its end."""
        if system == "kafka":
            walls = [m["wall_s"] for (_, rate), ms in self.runs.items() if rate == trace.config.rate for m in ms]
            result = asyncio.run(run_kafka(self.kafka.bootstrap, trace, self.kafka_warmup, model=self.args.model,
                                           max_model_len=self.runner.max_model_len, threads=self.threads,
                                           stream=True, timeout_s=kafka_timeout_s(trace, walls),
                                           log_dir=self.kafka.tmp))
        elif system in ENGINE_POLICIES:
            result = run_engine_policy(self.runner, system, trace)
        else:
            result = self.hf.run(system, trace)
        metrics = compute_metrics(result)
        metrics["load_at_end"] = os.getloadavg()[0]
        return metrics

    def warm_up(self) -> None:
        """Not recorded: first calls allocate, build kernels' caches and import lazily. A Kafka run warms its
        own fresh worker up (run_kafka's warm-up trace) before every measured trace."""
        warm = generate_trace(TraceConfig(rate=0, num_requests=2, profile="tiny", seed=99,
                                          min_token_id=self.min_token_id, vocab_size=self.runner.vocab_size))
        for system in self.args.systems:
            if system != "kafka":
                self.run(system, warm)

    def choose_rates(self) -> tuple[list[float], dict | None]:
        """--rates as given; else the factors times C, the continuous engine's offline req/s measured here on
        a --num-requests trace (factor 0: offline). Returns the rates and that calibration run's metrics."""
        if self.args.rates:
            return [float(r) for r in self.args.rates.split(",")], None
        started = time.monotonic()
        calibration = self.run("continuous", self.trace_at(0.0, self.args.num_requests))
        capacity = calibration["requests_per_s"]
        factors = [float(f) for f in self.args.factors.split(",")] if self.args.factors else (
            [0.7, 0.0] if self.args.quick else [0.5, 1.0, 2.0, 0.0])
        rates = [round(f * capacity, 3) for f in factors]  # factor 0: offline
        say(f"calibration: continuous offline {capacity:.3f} req/s in {time.monotonic() - started:.0f} s; "
            f"rates {rates}")
        return rates, calibration

    def run_repetitions(self, rates: list[float], traces: dict[float, Trace]) -> None:
        """Every repetition replays every rate's trace on every system (--offline-systems at the offline
        point), systems interleaved so that drift in machine load spreads over all of them."""
        reps = self.args.reps
        for rep in range(reps):
            for rate in rates:
                for system in (self.args.offline_systems if is_offline(rate) else self.args.systems):
                    if system == "kafka" and self.kafka_failed:
                        continue
                    try:
                        metrics = self.run(system, traces[rate])
                    except Exception as exc:
                        if system != "kafka":
                            raise
                        self._note_kafka_failure(rep, rate, exc)
                        continue
                    self.runs.setdefault((system, rate), []).append(metrics)
                    say(f"rep {rep + 1}/{reps} " + format_run(metrics) + f" load={metrics['load_at_end']:.1f}")

    def _note_kafka_failure(self, rep: int, rate: float, exc: Exception) -> None:
        # One failed Kafka run (worker crash, timeout) costs the Kafka figures from here on, not the rest of
        # the sweep; its worker log stays for a look.
        self.kafka_failed = self.kafka.keep = True
        where = rate_label(None if is_offline(rate) else rate)
        self.notes.append(f"kafka: rep {rep + 1} at rate {where} failed ({type(exc).__name__}: {exc}); no "
                          f"further Kafka runs. Broker data and worker logs kept in {self.kafka.tmp}.")
        say(self.notes[-1])

    def max_concurrent(self) -> int | None:
        """The most requests any engine policy's run had running at once."""
        return max((m["max_concurrent"] for (s, _), ms in self.runs.items() if s in ENGINE_POLICIES for m in ms),
                   default=None)


def summarize_overhead(overhead_runs: list[dict]) -> dict | None:
    """Median [min, max] over the repetitions of measure_overhead; None when it did not run."""
    if not overhead_runs:
        return None
    overhead = {k: median_min_max([o[k] for o in overhead_runs])
                for k in ("step_s_median", "forward_s_median", "overhead_fraction")}
    overhead.update(num_running=overhead_runs[0]["num_running"], n=len(overhead_runs))
    say(f"engine overhead: {overhead['overhead_fraction']}")
    return overhead


def sweep_config(args: argparse.Namespace, rates: list[float], max_model_len: int) -> dict:
    """What the sweep ran and with which limits: results.json's config and report.md's setup table."""
    return {"model": args.model, "profile": args.profile, "num_requests": args.num_requests, "reps": args.reps,
            "seed": args.seed, "systems": args.systems, "rates": rates,
            **({"offline_requests": args.offline_requests, "offline_systems": args.offline_systems}
               if any(is_offline(r) for r in rates) else {}),
            "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_batch_size (dynamic, static, hf-static)": MAX_BATCH_SIZE, "block_size": BLOCK_SIZE,
            "kv_cache_bytes": KV_CACHE_BYTES, "max_model_len": max_model_len,
            "prefix_caching": False, "ignore_eos": True}


def noise_note(env: dict, runs: dict[tuple[str, float], list[dict]], reps: int) -> str:
    """The load averages around and during the sweep, and whether the machine was shared."""
    loads = [m["load_at_end"] for ms in runs.values() for m in ms]
    return (f"1-minute load average: {env['load_before'][0]:.2f} before, {env['load_after'][0]:.2f} after, "
            f"{min(loads):.2f}–{max(loads):.2f} at the end of the runs, on {env['num_cpus']} cores. "
            f"{SHARED_NOTE if max(loads) > (env['num_cpus'] or 1) else ''}"
            f"{reps} repetition(s) per point; the brackets show their spread.")


# ---- writing the report ---------------------------------------------------------------------------------


def write_report(results: dict, out_dir: Path) -> None:
    """Floors from the measured points, then summary.json (each point's summary, without its repetitions'
    metrics), report.md and the plots in out_dir, and the full results.json in the run's raw folder."""
    config = results["config"]
    results["floors"] = check_floors(results["points"], results["overhead"], config["systems"],
                                     results.get("kv_capacity"), config.get("offline_systems"))
    results = finite_or_none(results)
    summary = {**results, "points": [{k: v for k, v in p.items() if k != "runs"} for p in results["points"]]}
    write_results(out_dir, results, summary, indent=1, allow_nan=False)
    (out_dir / "report.md").write_text(render_markdown(results))
    plots = render_plots(results, out_dir)
    say(f"wrote {out_dir / 'report.md'}, summary.json and {len(plots)} plots; raw results in {raw_dir(out_dir)}")
    print(render_markdown(results))


def rerender(out_dir: Path) -> int:
    """Floors, report.md and plots again from a run's results (measurements untouched), for a report written
    before a floor or a table was added: the raw results.json where this machine has it, else summary.json."""
    results = read_results(out_dir)
    write_report(results, out_dir)
    return 0


def finite_or_none(value):
    """NaN and infinity become None, so results.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
