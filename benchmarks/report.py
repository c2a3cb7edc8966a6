"""`make bench`: sweep arrival rates for every system on one trace per rate, repeat, and write a report.

    python -m benchmarks.report                 # full sweep (~30-40 min on an idle 2-core CPU)
    python -m benchmarks.report --quick         # smoke run, a few minutes
    python -m benchmarks.report --systems continuous,static --rates 0.5,1,0 --reps 3

Without --rates the sweep is calibrated on this machine: the continuous engine's offline throughput C
(requests/s, all requests at t=0) is measured once, and the rates are 0.5·C, 1.0·C and 2.0·C (light load, at
and beyond saturation); --quick uses 0.7·C and offline; --factors chooses others (0 = offline). Every system
sees the same trace at a rate; repetitions replay it again (systems interleaved, so drift in machine load
spreads over all of them). Writes benchmarks/results/<date>[-quick]/{results.json, report.md, *.png, traces/}.

The ~30-40 min estimate (20 requests of the cpu profile, 3 points, 5 systems, 3 repetitions) comes from
per-run wall times measured on a 2-core EPYC; on a machine shared with other work (load above the core count)
expect it to take longer; --num-requests, --factors and --systems cut it down.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import bench_engine as be
from benchmarks.render import render_markdown, render_plots
from benchmarks.run_result import compute_metrics
from benchmarks.stats import median_min_max, ratio
from benchmarks.trace import Trace, TraceConfig, generate_trace

RESULTS_DIR = Path(__file__).parent / "results"
SHARED_NOTE = "The machine was shared with other processes: figures are noisy and slower than on an idle machine. "
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


def check_floors(points: list[dict], overhead: dict | None) -> list[dict]:
    """The floors of the brief, checked at every rate where both continuous and static ran."""
    by = {(p["system"], p["rate"]): p["summary"] for p in points}
    floors = []
    for (system, rate), cont in by.items():
        static = by.get(("static", rate))
        if system != "continuous" or static is None:
            continue
        tput = ratio(cont["output_tokens_per_s"]["median"], static["output_tokens_per_s"]["median"])
        floors.append({"check": "continuous/static output tok/s", "rate": rate, "value": tput, "floor": ">= 2",
                       "pass": tput >= 2})
        p99 = ratio(cont["short_e2e_p99"]["median"], static["short_e2e_p99"]["median"])
        floors.append({"check": "continuous/static short e2e p99", "rate": rate, "value": p99, "floor": "<= 0.333",
                       "pass": p99 <= 1 / 3})
    if overhead:
        value = overhead["overhead_fraction"]["median"]
        floors.append({"check": f"engine overhead at {overhead['num_running']} running", "rate": "–",
                       "value": value, "floor": "<= 0.10", "pass": value <= 0.10})
    return floors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny lengths, few requests, 1 repetition")
    parser.add_argument("--systems", default=",".join(be.ALL_SYSTEMS))
    parser.add_argument("--rates", help="comma-separated req/s; 0 = offline. Default: calibrated (see above)")
    parser.add_argument("--factors", help="calibrated rates as multiples of C, 0 = offline "
                        "(default 0.5,1,2; 0.7,0 with --quick)")
    parser.add_argument("--reps", type=int, help="repetitions per point (default 3; 1 with --quick)")
    parser.add_argument("--num-requests", type=int, help="requests per trace (default 20; 6 with --quick)")
    parser.add_argument("--profile", help="trace length profile (default cpu; tiny with --quick)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: see bench_engine.set_threads)")
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    num_requests = args.num_requests or (6 if args.quick else 20)
    profile = args.profile or ("tiny" if args.quick else "cpu")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    notes = []
    if "kafka" in systems:
        systems.remove("kafka")
        notes.append("kafka: not part of the rate sweep; the Kafka path is measured against the in-process "
                     "engine by benchmarks/bench_kafka_path.py.")
    unknown = set(systems) - set(be.ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {be.ALL_SYSTEMS}")
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

    def trace_at(rate: float) -> Trace:
        return generate_trace(TraceConfig(rate=rate, num_requests=num_requests, profile=profile, seed=args.seed,
                                          min_token_id=low, vocab_size=runner.vocab_size))

    def run(system: str, trace: Trace) -> dict:
        result = be.run_engine_policy(runner, system, trace) if system in be.ENGINE_POLICIES else hf.run(system, trace)
        metrics = compute_metrics(result)
        metrics["load_at_end"] = os.getloadavg()[0]
        return metrics

    # Warm-up (not recorded): first calls allocate, build kernels' caches and import lazily.
    warm = generate_trace(TraceConfig(rate=0, num_requests=2, profile="tiny", seed=99, min_token_id=low,
                                      vocab_size=runner.vocab_size))
    for system in systems:
        run(system, warm)

    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
        calibration = None
    else:
        started = time.monotonic()
        calibration = run("continuous", trace_at(0.0))
        capacity = calibration["requests_per_s"]
        factors = [float(f) for f in args.factors.split(",")] if args.factors else (
            [0.7, 0.0] if args.quick else [0.5, 1.0, 2.0])
        rates = [round(f * capacity, 3) for f in factors]  # factor 0: offline
        say(f"calibration: continuous offline {capacity:.3f} req/s in {time.monotonic() - started:.0f} s; "
            f"rates {rates}")
    traces = {rate: trace_at(rate) for rate in rates}
    for rate, trace in traces.items():
        trace.save(out_dir / "traces" / f"rate_{rate:g}.json")

    runs: dict[tuple[str, float], list[dict]] = {}
    for rep in range(reps):
        for rate in rates:
            for system in systems:
                metrics = run(system, traces[rate])
                runs.setdefault((system, rate), []).append(metrics)
                say(f"rep {rep + 1}/{reps} " + be.format_run(metrics) + f" load={metrics['load_at_end']:.1f}")

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
    results["floors"] = check_floors(points, overhead)
    results = finite_or_none(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False))
    (out_dir / "report.md").write_text(render_markdown(results))
    plots = render_plots(results, out_dir)
    say(f"wrote {out_dir / 'report.md'}, results.json and {len(plots)} plots")
    print(render_markdown(results))
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
