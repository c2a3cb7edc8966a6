"""`make bench`: sweep arrival rates for every system on one trace per rate, repeat, and write a report.

    python -m benchmarks.report                 # full sweep (~110 min on an idle 2-core CPU)
    python -m benchmarks.report --quick         # smoke run, a few minutes
    python -m benchmarks.report --systems continuous,static --rates 0.5,1,0 --reps 3

Systems (default: all): the engine's policies `continuous`, `dynamic`, `static` (benchmarks/bench_engine.py),
transformers' `hf-static` and `hf-cb` (benchmarks/hf_systems.py), and `kafka`: the continuous policy behind
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
benchmarks/results/<date>[-quick]/{results.json, report.md, *.png, traces/}.

The offline point's trace holds --offline-requests requests (default 48), more than the rated traces: with
20 requests at t=0 the run's length is mostly the drain of its three or four long requests running nearly
alone, which measures their latency, not the throughput a system sustains with a queue. hf-static sits the
offline point out unless --offline-systems names it (6 min per repetition there, and no floor reads it).

Floors (check_floors): continuous vs static at every rate (2x output tok/s, 1/3 of the short e2e p99) and, in
issue #7's form, continuous's sustained output tok/s (its own p99 under 10 s) >= 2x static's at the highest rate
where static's p99 e2e stays under 10 s (all requests, and short requests alone); continuous vs hf-cb 1.5x
output tok/s at saturation (the highest rate both ran: the offline point); kafka vs continuous 0.90x output
tok/s at every rate (issue #5); paged KV >= 3x the requests of max-length contiguous reservation in the same budget;
engine overhead at most 10%. `--rerender DIR` recomputes floors, report.md and plots from DIR/results.json.

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
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import bench_engine as be
from benchmarks.bench_kafka_path import FLOOR as KAFKA_FLOOR
from benchmarks.bench_kafka_path import kafka_session, run_kafka, warmup_trace
from benchmarks.render import rate_label, render_markdown, render_plots
from benchmarks.run_result import compute_metrics
from benchmarks.stats import median_min_max, ratio
from benchmarks.trace import Trace, TraceConfig, generate_trace

RESULTS_DIR = Path(__file__).parent / "results"
SHARED_NOTE = "The machine was shared with other processes: figures are noisy and slower than on an idle machine. "
DEFAULT_SYSTEMS = be.ALL_SYSTEMS + ("kafka",)
"""What `make bench` measures: the engine policies, transformers' baselines and the Kafka path."""
STATIC_P99_LIMIT_S = 10.0
OFFLINE_REQUESTS = 48
"""Requests in the offline (saturation) point's trace; see the module docstring."""
OFFLINE_SKIPS = ("hf-static",)
"""Systems that sit the offline point out by default."""
SUMMARY_KEYS = ("output_tokens_per_s", "requests_per_s", "kv_utilisation_mean", "kv_pool_usage_max",
                "max_concurrent", "num_completed")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


def _median(summary: dict, key: str) -> float:
    stat = summary.get(key)
    value = stat.get("median") if stat else None
    return math.nan if value is None else value


def _rate_order(rate: float | None) -> float:
    return math.inf if rate is None else rate  # None: offline, beyond every finite rate


def p99_e2e(summary: dict) -> float:
    """Median p99 end-to-end latency over all requests; where that was not recorded, the worse of short and
    long (both must stay under a limit)."""
    value = _median(summary, "all_e2e_p99")
    if not math.isnan(value):
        return value
    values = [v for v in (_median(summary, f"{kind}_e2e_p99") for kind in ("short", "long")) if not math.isnan(v)]
    return max(values, default=math.nan)


def offline_systems(systems: list[str], named: str | None) -> list[str]:
    """Who runs the offline point: the systems named (each must be in the sweep), else the sweep's systems
    less OFFLINE_SKIPS."""
    if named is None:
        return [s for s in systems if s not in OFFLINE_SKIPS]
    chosen = parse_systems(named)
    if stray := [s for s in chosen if s not in systems]:
        raise ValueError(f"--offline-systems {','.join(stray)} not in --systems")
    return [s for s in systems if s in chosen]


def check_floors(points: list[dict], overhead: dict | None, systems: list[str] | None = None,
                 kv_capacity: dict | None = None, offline: list[str] | None = None) -> list[dict]:
    """The floors, from the medians over repetitions (a point with rate None ran offline, the highest load):

    - continuous/static output tok/s >= 2 and short e2e p99 <= 1/3 of static's, at every rate where both ran;
    - issue #7's form of the throughput floor (see _slo_floor), once for the all-requests p99 and once for
      short requests' p99; recorded as failed, value None, where no rate qualifies;
    - continuous/hf-cb output tok/s >= 1.5 at saturation: the highest rate where both ran (offline, when
      both ran it);
    - kafka/continuous output tok/s >= 0.90 (issue #5) at every rate where both ran; with `systems` naming kafka
      (`offline` for the offline point, when given), a rate where continuous ran but no kafka run completed is
      recorded as failed;
    - paged KV holds >= 3x the requests of max-length contiguous reservation in the same KV budget (requests
      of the trace's lengths in whole blocks, against max_model_len each);
    - engine overhead <= 10% (last)."""
    by = {(p["system"], p["rate"]): p["summary"] for p in points}

    def rates_with(*names: str) -> list[float | None]:
        rates = {rate for (_, rate) in by}
        return sorted((r for r in rates if all((n, r) in by for n in names)), key=_rate_order)

    def tok_s_ratio(num: str, den: str, rate: float | None) -> float:
        return ratio(_median(by[(num, rate)], "output_tokens_per_s"), _median(by[(den, rate)], "output_tokens_per_s"))

    floors = []
    with_static = rates_with("continuous", "static")
    for rate in with_static:
        tput = tok_s_ratio("continuous", "static", rate)
        floors.append({"check": "continuous/static output tok/s", "rate": rate, "value": tput, "floor": ">= 2",
                       "pass": tput >= 2, "note": "issue #3"})
        p99 = ratio(_median(by[("continuous", rate)], "short_e2e_p99"), _median(by[("static", rate)], "short_e2e_p99"))
        floors.append({"check": "continuous/static short e2e p99", "rate": rate, "value": p99, "floor": "<= 0.333",
                       "pass": p99 <= 1 / 3, "note": "issue #3"})
    if with_static:
        for label, p99_of in (("p99 e2e", p99_e2e), ("short p99 e2e", lambda m: _median(m, "short_e2e_p99"))):
            floors.append(_slo_floor(by, with_static, rates_with("continuous"), label, p99_of))
    with_hf_cb = rates_with("continuous", "hf-cb")
    if with_hf_cb:
        rate = with_hf_cb[-1]
        tput = tok_s_ratio("continuous", "hf-cb", rate)
        floors.append({"check": "continuous/hf-cb output tok/s at saturation", "rate": rate, "value": tput,
                       "floor": ">= 1.5", "pass": tput >= 1.5, "note": "saturation: the highest rate where both ran"})
    kafka_check = "kafka/continuous output tok/s"
    for rate in rates_with("continuous"):
        if ("kafka", rate) in by:
            value = tok_s_ratio("kafka", "continuous", rate)
            floors.append({"check": kafka_check, "rate": rate, "value": value, "floor": f">= {KAFKA_FLOOR:g}",
                           "pass": value >= KAFKA_FLOOR, "note": "issue #5"})
        elif "kafka" in ((offline if rate is None and offline is not None else systems) or ()):
            floors.append({"check": kafka_check, "rate": rate, "value": None, "floor": f">= {KAFKA_FLOOR:g}",
                           "pass": False, "note": "no Kafka run completed at this rate"})
    kv = kv_capacity
    if kv and kv.get("contiguous_max_len_capacity"):
        value = ratio(kv["paged_capacity_at_trace_lengths"], kv["contiguous_max_len_capacity"])
        observed = kv.get("paged_observed_max_concurrent")
        floors.append({"check": "paged / contiguous max-length KV: requests that fit", "rate": "–", "value": value,
                       "floor": ">= 3", "pass": value >= 3,
                       "note": f"{kv['paged_capacity_at_trace_lengths']} vs {kv['contiguous_max_len_capacity']} in "
                               f"{kv['kv_budget_bytes'] / 2**20:.0f} MiB"
                               + (f"; {observed} ran at once in the sweep" if observed else "")})
    if overhead:
        value = overhead["overhead_fraction"]["median"]
        floors.append({"check": f"engine overhead at {overhead['num_running']} running", "rate": "–",
                       "value": value, "floor": "<= 0.10", "pass": value <= 0.10})
    return floors


def _slo_floor(by: dict, with_static: list, with_continuous: list, label: str, p99_of) -> dict:
    """Issue #7: r* = the highest rate where static keeps its p99 (`p99_of`) under the limit; continuous's
    sustained throughput (its highest output tok/s at a rate where its own p99 stays under the same limit)
    must be >= 2x static's output tok/s at r*. Comparing both at r* itself would say nothing: below
    saturation every system's throughput is the offered load."""
    check = f"continuous sustained / static output tok/s, {label} < {STATIC_P99_LIMIT_S:g} s"
    under = [r for r in with_static if p99_of(by[("static", r)]) < STATIC_P99_LIMIT_S]
    if not under:
        return {"check": check, "rate": "–", "value": None, "floor": ">= 2", "pass": False,
                "note": f"static {label} ≥ {STATIC_P99_LIMIT_S:g} s at every rate measured"}
    rate = under[-1]
    sustained = [(_median(by[("continuous", r)], "output_tokens_per_s"), r) for r in with_continuous
                 if p99_of(by[("continuous", r)]) < STATIC_P99_LIMIT_S]
    if not sustained:
        return {"check": check, "rate": rate, "value": None, "floor": ">= 2", "pass": False,
                "note": f"continuous {label} ≥ {STATIC_P99_LIMIT_S:g} s at every rate measured"}
    best, best_rate = max(sustained, key=lambda x: x[0])
    value = ratio(best, _median(by[("static", rate)], "output_tokens_per_s"))
    return {"check": check, "rate": rate, "value": value, "floor": ">= 2", "pass": value >= 2,
            "note": f"static at {rate_label(rate)} req/s ({label} {p99_of(by[('static', rate)]):.2f} s) vs "
                    f"continuous at {rate_label(best_rate)} req/s"}


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: see bench_engine.set_threads)")
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--rerender", type=Path, metavar="RESULTS_DIR",
                        help="measure nothing: recompute the floors, report.md and plots from RESULTS_DIR/results.json")
    args = parser.parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)
    reps = args.reps or (1 if args.quick else 3)
    num_requests = args.num_requests or (6 if args.quick else 20)
    offline_requests = args.offline_requests or (num_requests if args.quick else OFFLINE_REQUESTS)
    profile = args.profile or ("tiny" if args.quick else "cpu")
    try:
        systems = parse_systems(args.systems)
        at_offline = offline_systems(systems, args.offline_systems)
    except ValueError as exc:
        parser.error(str(exc))
    notes = []
    if "kafka" in systems:
        notes.append("kafka: the continuous policy behind the whole Kafka path: a LocalBroker started once for the "
                     "sweep, and per run fresh topics and one `llm-worker serve` subprocess with the same engine "
                     "settings and torch threads, shedding off, which joins its group and serves a 2-request "
                     "warm-up before the trace is sent; latencies are read on the client (TTFT = first stream "
                     "chunk); KV columns are not sampled. The broker, client and worker share the CPUs.")
    date = datetime.date.today().isoformat()
    out_dir = args.out_dir or RESULTS_DIR / (date + ("-quick" if args.quick else ""))
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)

    threads = be.set_threads(args.threads)
    env = environment(threads)
    say(f"torch threads {threads}; load {env['load_before'][0]:.2f}; writing to {out_dir}")
    runner = be.load_runner(args.model, profile)
    hf = None
    if any(s in be.HF_SYSTEMS for s in systems):
        from benchmarks.hf_systems import HFBaselines

        hf = HFBaselines(runner.model_path)
    low = be.min_token_id(runner.tokenizer)

    def trace_at(rate: float, size: int = num_requests) -> Trace:
        return generate_trace(TraceConfig(rate=rate, num_requests=size, profile=profile, seed=args.seed,
                                          min_token_id=low, vocab_size=runner.vocab_size))

    kafka_warmup = warmup_trace(low, runner.vocab_size)
    runs: dict[tuple[str, float], list[dict]] = {}

    def run(system: str, trace: Trace) -> dict:
        if system == "kafka":
            walls = [m["wall_s"] for (_, rate), ms in runs.items() if rate == trace.config.rate for m in ms]
            result = asyncio.run(run_kafka(kafka.bootstrap, trace, kafka_warmup, model=args.model,
                                           max_model_len=runner.max_model_len, threads=threads, stream=True,
                                           timeout_s=kafka_timeout_s(trace, walls), log_dir=kafka.tmp))
        elif system in be.ENGINE_POLICIES:
            result = be.run_engine_policy(runner, system, trace)
        else:
            result = hf.run(system, trace)
        metrics = compute_metrics(result)
        metrics["load_at_end"] = os.getloadavg()[0]
        return metrics

    # One broker for the whole sweep, started before the warm-up so that every measured run (calibration
    # included) shares the machine with it; stopped on every exit, Ctrl-C included (kafka_session).
    with kafka_session(prefix="bench-report-") if "kafka" in systems else contextlib.nullcontext() as kafka:
        if kafka is not None:
            say(f"Kafka broker at {kafka.bootstrap}; broker data and worker logs in {kafka.tmp}")
        # Warm-up (not recorded): first calls allocate, build kernels' caches and import lazily. A Kafka run
        # warms its own fresh worker up (run_kafka's warm-up trace) before every measured trace.
        warm = generate_trace(TraceConfig(rate=0, num_requests=2, profile="tiny", seed=99, min_token_id=low,
                                          vocab_size=runner.vocab_size))
        for system in systems:
            if system != "kafka":
                run(system, warm)

        if args.rates:
            rates = [float(r) for r in args.rates.split(",")]
            calibration = None
        else:
            started = time.monotonic()
            calibration = run("continuous", trace_at(0.0))
            capacity = calibration["requests_per_s"]
            factors = [float(f) for f in args.factors.split(",")] if args.factors else (
                [0.7, 0.0] if args.quick else [0.5, 1.0, 2.0, 0.0])
            rates = [round(f * capacity, 3) for f in factors]  # factor 0: offline
            say(f"calibration: continuous offline {capacity:.3f} req/s in {time.monotonic() - started:.0f} s; "
                f"rates {rates}")
        traces = {rate: trace_at(rate, offline_requests if be_offline(rate) else num_requests) for rate in rates}
        for rate, trace in traces.items():
            trace.save(out_dir / "traces" / f"rate_{rate:g}.json")

        kafka_failed = False
        for rep in range(reps):
            for rate in rates:
                for system in (at_offline if be_offline(rate) else systems):
                    if system == "kafka" and kafka_failed:
                        continue
                    try:
                        metrics = run(system, traces[rate])
                    except Exception as exc:
                        if system != "kafka":
                            raise
                        # One failed Kafka run (worker crash, timeout) costs the Kafka figures from here on,
                        # not the rest of the sweep; its worker log stays for a look.
                        kafka_failed = kafka.keep = True
                        where = rate_label(None if be_offline(rate) else rate)
                        notes.append(f"kafka: rep {rep + 1} at rate {where} failed ({type(exc).__name__}: {exc}); no "
                                     f"further Kafka runs. Broker data and worker logs kept in {kafka.tmp}.")
                        say(notes[-1])
                        continue
                    runs.setdefault((system, rate), []).append(metrics)
                    say(f"rep {rep + 1}/{reps} " + be.format_run(metrics) + f" load={metrics['load_at_end']:.1f}")
    if not kafka_failed:  # the logs went with the temporary folder
        for ms in runs.values():
            for m in ms:
                m.pop("worker_log", None)

    overhead_steps = 4 if args.quick else 16
    overhead_runs = ([be.measure_overhead(runner, num_steps=overhead_steps) for _ in range(reps)]
                     if "continuous" in systems else [])
    overhead = None
    if overhead_runs:
        overhead = {k: median_min_max([o[k] for o in overhead_runs])
                    for k in ("step_s_median", "forward_s_median", "overhead_fraction")}
        overhead.update(num_running=overhead_runs[0]["num_running"], n=len(overhead_runs))
        say(f"engine overhead: {overhead['overhead_fraction']}")

    points = [{"system": s, "rate": None if be_offline(r) else r, "summary": summarize(ms), "runs": ms}
              for (s, r), ms in runs.items()]
    observed = max((m["max_concurrent"] for (s, _), ms in runs.items() if s in be.ENGINE_POLICIES for m in ms),
                   default=None)
    env["load_after"] = list(os.getloadavg())
    loads = [m["load_at_end"] for ms in runs.values() for m in ms]
    noise = (f"1-minute load average: {env['load_before'][0]:.2f} before, {env['load_after'][0]:.2f} after, "
             f"{min(loads):.2f}–{max(loads):.2f} at the end of the runs, on {env['num_cpus']} cores. "
             f"{SHARED_NOTE if max(loads) > (env['num_cpus'] or 1) else ''}"
             f"{reps} repetition(s) per point; the brackets show their spread.")
    results = {
        "environment": env,
        "config": {"model": args.model, "profile": profile, "num_requests": num_requests, "reps": reps,
                   "seed": args.seed, "systems": systems, "rates": rates,
                   **({"offline_requests": offline_requests, "offline_systems": at_offline}
                      if any(be_offline(r) for r in rates) else {}),
                   "max_num_seqs": be.MAX_NUM_SEQS, "max_num_batched_tokens": be.MAX_NUM_BATCHED_TOKENS,
                   "max_batch_size (dynamic, static, hf-static)": be.MAX_BATCH_SIZE, "block_size": be.BLOCK_SIZE,
                   "kv_cache_bytes": be.KV_CACHE_BYTES, "max_model_len": runner.max_model_len,
                   "prefix_caching": False, "ignore_eos": True},
        "calibration": calibration,
        "noise_note": noise,
        "points": points,
        "kv_capacity": be.kv_capacity(runner, traces[rates[0]], observed),
        "overhead": overhead,
        "overhead_runs": overhead_runs,
        "notes": notes,
    }
    write_report(results, out_dir)
    return 0


def write_report(results: dict, out_dir: Path) -> None:
    """Floors from the measured points, then results.json, report.md and the plots."""
    config = results["config"]
    results["floors"] = check_floors(results["points"], results["overhead"], config["systems"],
                                     results.get("kv_capacity"), config.get("offline_systems"))
    results = finite_or_none(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False))
    (out_dir / "report.md").write_text(render_markdown(results))
    plots = render_plots(results, out_dir)
    say(f"wrote {out_dir / 'report.md'}, results.json and {len(plots)} plots")
    print(render_markdown(results))


def rerender(out_dir: Path) -> int:
    """Floors, report.md and plots again from a results folder's results.json (measurements untouched), for
    a report written before a floor or a table was added."""
    results = json.loads((out_dir / "results.json").read_text())
    write_report(results, out_dir)
    return 0


def be_offline(rate: float) -> bool:
    return rate <= 0 or rate == math.inf


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
