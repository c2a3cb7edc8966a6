"""Engine-level benchmark: replay a trace in real time against LLMEngine and transformers' baselines.

Systems (all on one model instance per family, loaded once per process):
  continuous  LLMEngine, iteration-level batching (EngineSettings.policy)
  dynamic     LLMEngine, windowed batches that run to completion
  static      LLMEngine, fixed batches of max_batch_size in arrival order
  hf-static   transformers `generate` on left-padded batches of max_batch_size in arrival order; each batch
              runs to the longest output in it (benchmarks/lib/hf_systems.py)
  hf-cb       transformers' continuous batching manager (benchmarks/lib/hf_systems.py)

Every LLMEngine run gets a fresh scheduler and block pool over the same ModelRunner (weights and KV
memory), with the same limits for every policy (benchmarks/lib/settings.py). Requests ignore EOS, so each
produces exactly the output length the trace says. Arrivals are open-loop: a request that arrives while a
step runs is added after it, with its arrival time set to when it arrived, so queueing counts in latency.

    python -m benchmarks.bench_engine --rate 2 --num-requests 40 --systems continuous,static
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

from benchmarks.lib.hf_systems import HFBaselines
from benchmarks.lib.run_result import RequestRecord, RunResult, compute_metrics
from benchmarks.lib.settings import (ALL_SYSTEMS, DEFAULT_MODEL, ENGINE_POLICIES, MAX_NUM_SEQS, engine_settings,
                                     load_runner, min_token_id, set_threads)
from benchmarks.lib.trace import Trace, TraceConfig, generate_trace
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner

log = logging.getLogger(__name__)


# ---- LLMEngine replay ---------------------------------------------------------------------------------


class _Replay:
    """One real-time replay of a trace against an LLMEngine: arrivals in, outputs recorded, KV sampled."""

    def __init__(self, engine: LLMEngine, trace: Trace) -> None:
        self.engine = engine
        self.requests = trace.requests
        self.records = {r.request_id: RequestRecord(r.request_id, r.kind, r.priority, r.arrival_s,
                                                    r.num_prompt_tokens) for r in self.requests}
        self.num_added = 0
        self.kv_util: list[float] = []
        """Per step: KV tokens held by running requests / slots in their blocks."""
        self.kv_usage: list[float] = []
        """Per step: fraction of the block pool in use."""
        self.max_running = 0
        self.start = time.monotonic()

    @property
    def next_arrival(self) -> float | None:
        """Monotonic time of the next request still to add; None once the trace is over."""
        if self.num_added == len(self.requests):
            return None
        return self.start + self.requests[self.num_added].arrival_s

    def add_arrived(self) -> None:
        """Adds every request whose arrival time has passed, with that arrival time (queueing counts in its
        latency); the last one also ends the input, so a static batch may start partial."""
        if self.num_added == len(self.requests):
            return
        now = time.monotonic()
        while self.num_added < len(self.requests) and self.next_arrival <= now:
            r = self.requests[self.num_added]
            sampling = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
            request = EngineRequest(r.request_id, prompt_token_ids=r.prompt_token_ids, sampling=sampling,
                                    priority=r.priority, arrival_time=self.start + r.arrival_s)
            for out in self.engine.add_request(request):  # rejected at once
                self.records[out.request_id].error = out.error_code or out.finish_reason
            self.num_added += 1
        if self.num_added == len(self.requests):
            self.engine.set_input_ended()

    def step(self) -> None:
        """One engine step (wake_time() was due, so the scheduler has running or admissible requests and the
        step runs the model), its finished requests recorded and the KV cache sampled after it."""
        for out in self.engine.step():
            if out.finished:
                record = self.records[out.request_id]
                record.num_output_tokens = out.num_output_tokens
                record.first_token_s = None if out.first_token_time is None else out.first_token_time - self.start
                record.finish_s = out.finish_time - self.start
                if out.finish_reason not in ("length", "stop"):
                    record.error = out.error_code or out.finish_reason
        scheduler = self.engine.scheduler
        running = scheduler.running
        self.max_running = max(self.max_running, len(running))
        held = sum(r.num_computed_tokens for r in running)
        allocated = sum(len(r.block_ids) for r in running) * scheduler.block_size
        if allocated:
            self.kv_util.append(held / allocated)
        self.kv_usage.append(scheduler.kv_usage)


def run_engine(engine: LLMEngine, trace: Trace, system: str) -> RunResult:
    """Replays `trace` in real time through the Engine contract (worker/engine/api.py), as the worker's engine
    thread drives it (worker/transport/requests/engine_thread.py): add what has arrived, step while wake_time() is
    due, otherwise sleep until the earlier of wake_time() and the next arrival. A request arriving while a
    step runs is added after it, with its arrival time, so queueing counts in latency (open loop)."""
    replay = _Replay(engine, trace)
    while True:
        replay.add_arrived()
        wake = engine.wake_time()
        if wake is not None and wake <= time.monotonic():
            replay.step()
            continue
        wakes = [t for t in (wake, replay.next_arrival) if t is not None]
        if not wakes:  # nothing can run and nothing more arrives
            if engine.has_unfinished():
                raise RuntimeError(f"{system}: unfinished requests, but wake_time() is None after the input ended")
            break
        time.sleep(max(0.0, min(wakes) - time.monotonic()))
    wall = time.monotonic() - replay.start
    stats = engine.stats()
    return RunResult(system, trace.config.rate, list(replay.records.values()), wall, replay.kv_util,
                     replay.kv_usage, replay.max_running,
                     extra={"num_steps": stats.num_steps, "num_preemptions": stats.num_preemptions})


def run_engine_policy(runner: ModelRunner, policy: str, trace: Trace) -> RunResult:
    engine = LLMEngine(engine_settings(policy, runner.max_model_len), runner=runner)
    return run_engine(engine, trace, policy)


# ---- engine overhead at a fixed number of running requests ----------------------------------------------


def measure_overhead(runner: ModelRunner, num_seqs: int = 64, prompt_len: int = 32, num_steps: int = 16,
                     seed: int = 1) -> dict:
    """Time outside the model forward / whole step, over decode steps with `num_seqs` requests running.

    runner.execute is wrapped from outside (engine.py is not touched): everything else in step() (schedule,
    building the flat batch, sampling, update, detokenizing, outputs) counts as engine overhead."""
    engine = _engine_decoding(runner, num_seqs, prompt_len, num_steps, seed)
    step_s, forward_s = _time_decode_steps(engine, runner, num_steps)
    outside = [s - f for s, f in zip(step_s, forward_s)]
    return {
        "num_running": num_seqs,
        "num_steps": num_steps,
        "step_s_median": statistics.median(step_s),
        "forward_s_median": statistics.median(forward_s),
        "outside_forward_s_median": statistics.median(outside),
        "overhead_fraction": sum(outside) / sum(step_s),
        "overhead_fraction_median_step": statistics.median(o / s for o, s in zip(outside, step_s)),
    }


def _engine_decoding(runner: ModelRunner, num_seqs: int, prompt_len: int, num_steps: int, seed: int) -> LLMEngine:
    """A continuous engine with `num_seqs` requests of `prompt_len` prompt tokens prefilled and decoding, each
    with room for `num_steps` more decode steps."""
    settings = engine_settings("continuous", runner.max_model_len, max_num_seqs=num_seqs)
    engine = LLMEngine(settings, runner=runner)
    low = min_token_id(engine.tokenizer)
    trace = generate_trace(TraceConfig(rate=math.inf, num_requests=num_seqs, profile="tiny", seed=seed,
                                       min_token_id=low, vocab_size=runner.vocab_size))
    warm_steps = 64
    for r in trace.requests:
        prompt = (r.prompt_token_ids * (prompt_len // len(r.prompt_token_ids) + 1))[:prompt_len]
        sampling = SamplingParams(max_new_tokens=warm_steps + num_steps + 8, ignore_eos=True)
        engine.add_request(EngineRequest(r.request_id, prompt_token_ids=prompt, sampling=sampling))
    for _ in range(warm_steps):  # prefill everyone (chunked), then a couple of decode steps
        engine.step()
        running = engine.scheduler.running
        if len(running) == num_seqs and all(r.num_output_tokens >= 2 for r in running):
            break
    assert engine.scheduler.num_running == num_seqs, (engine.scheduler.num_running, num_seqs)
    return engine


def _time_decode_steps(engine: LLMEngine, runner: ModelRunner, num_steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each of `num_steps` whole steps, and of the model forward inside each; every request that
    runs at the start keeps running throughout."""
    num_running = engine.scheduler.num_running
    execute = runner.execute
    forward_s: list[float] = []

    def timed_execute(model_input, **kwargs):
        t0 = time.perf_counter()
        try:
            return execute(model_input, **kwargs)
        finally:
            forward_s.append(time.perf_counter() - t0)

    runner.execute = timed_execute
    step_s = []
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            assert engine.scheduler.num_running == num_running
    finally:
        del runner.execute  # back to the class method
    return step_s, forward_s


# ---- KV memory: paged vs contiguous reservation ---------------------------------------------------------


def kv_capacity(runner: ModelRunner, trace: Trace, observed_max_concurrent: int | None = None) -> dict:
    """For the runner's KV budget: how many requests fit when each reserves a max_model_len contiguous cache,
    vs paged blocks at the trace's real lengths (prompt + output rounded up to whole blocks)."""
    bytes_per_token = runner.bytes_per_block // runner.block_size
    budget_bytes = runner.num_blocks * runner.bytes_per_block
    block = runner.block_size
    blocks_per_request = [-(-(r.num_prompt_tokens + r.max_new_tokens) // block) for r in trace.requests]
    mean_blocks = statistics.mean(blocks_per_request)
    mean_tokens = statistics.mean(r.num_prompt_tokens + r.max_new_tokens for r in trace.requests)
    return {
        "kv_budget_bytes": budget_bytes,
        "bytes_per_token": bytes_per_token,
        "max_model_len": runner.max_model_len,
        "contiguous_max_len_capacity": budget_bytes // (runner.max_model_len * bytes_per_token),
        "paged_capacity_at_trace_lengths": int(runner.num_blocks // mean_blocks),
        "paged_utilisation_at_trace_lengths": mean_tokens / (mean_blocks * block),
        "contiguous_utilisation_at_trace_lengths": mean_tokens / runner.max_model_len,
        "paged_observed_max_concurrent": observed_max_concurrent,
        "max_num_seqs": MAX_NUM_SEQS,
    }


# ---- command line -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s; 0 = all at t=0 (offline)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, help="replay this trace file instead of generating one")
    parser.add_argument("--overhead", action="store_true", help="also measure engine overhead at 64 running")
    parser.add_argument("--overhead-seqs", default="",
                        help="comma-separated running-request counts to measure decode step time and overhead at "
                             "(e.g. 1,16,64: how step time scales with the batch on this machine)")
    parser.add_argument("--out", type=Path, help="write the metrics as JSON here")
    parser.add_argument("--threads", type=int, help="torch threads (default: see settings.set_threads)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (float32 keeps earlier figures "
                        "comparable; bfloat16 is what a worker runs on a CPU with bf16 units)")
    parser.add_argument("--row-buckets", default="auto", choices=("auto", "on", "off"),
                        help="ENGINE_ROW_BUCKETS: fixed matmul rows and attention kernels")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"torch threads: {set_threads(args.threads)}", flush=True)
    runner = load_runner(args.model, args.profile, dtype=args.dtype, row_buckets=args.row_buckets)
    if args.trace:
        trace = Trace.load(args.trace)
    else:
        trace = generate_trace(TraceConfig(rate=args.rate, num_requests=args.num_requests, profile=args.profile,
                                           seed=args.seed, min_token_id=min_token_id(runner.tokenizer),
                                           vocab_size=runner.vocab_size))
    results = {"runs": run_systems(runner, args.systems, trace), "kv_capacity": None, "overhead": None}
    observed = max((m["max_concurrent"] for m in results["runs"] if m["system"] in ENGINE_POLICIES), default=None)
    results["kv_capacity"] = kv_capacity(runner, trace, observed)
    print(json.dumps(results["kv_capacity"], indent=1))
    seqs = [int(n) for n in args.overhead_seqs.split(",") if n] or ([MAX_NUM_SEQS] if args.overhead else [])
    if seqs:
        results["overhead"] = [measure_overhead(runner, num_seqs=n) for n in seqs]
        for o in results["overhead"]:
            print(f"{o['num_running']:>3} running: step {o['step_s_median'] * 1000:.1f} ms, forward "
                  f"{o['forward_s_median'] * 1000:.1f} ms, overhead {o['overhead_fraction']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def run_systems(runner: ModelRunner, systems: list[str], trace: Trace) -> list[dict]:
    """Each system's metrics on `trace`, printed as they come; transformers' models load on first use."""
    runs, hf = [], None
    for system in systems:
        if system in ENGINE_POLICIES:
            run = run_engine_policy(runner, system, trace)
        else:
            hf = hf or HFBaselines(runner.model_path)
            run = hf.run(system, trace)
        runs.append(compute_metrics(run))
        print(format_run(runs[-1]), flush=True)
    return runs


def format_run(m: dict) -> str:
    short, long_ = m["latency"].get("short", {}), m["latency"].get("long", {})

    def p(d: dict, key: str, q: str) -> str:
        return f"{d[key][q]:.2f}" if d and d[key]["n"] else "-"

    return (f"{m['system']:<11} rate={m['rate']} done={m['num_completed']}/{m['num_requests']} "
            f"wall={m['wall_s']:.1f}s tok/s={m['output_tokens_per_s']:.1f} req/s={m['requests_per_s']:.2f} "
            f"short ttft p50/p99={p(short, 'ttft', 'p50')}/{p(short, 'ttft', 'p99')} "
            f"e2e p50/p99={p(short, 'e2e', 'p50')}/{p(short, 'e2e', 'p99')} "
            f"long e2e p50/p99={p(long_, 'e2e', 'p50')}/{p(long_, 'e2e', 'p99')} "
            f"kv_util={m['kv_utilisation_mean']:.2f} max_conc={m['max_concurrent']}")


if __name__ == "__main__":
    raise SystemExit(main())
