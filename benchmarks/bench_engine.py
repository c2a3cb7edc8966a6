"""Engine-level benchmark: replay a trace in real time against LLMEngine and transformers' baselines.

Systems (all on one model instance per family, loaded once per process):
  continuous  LLMEngine, iteration-level batching (EngineSettings.policy)
  dynamic     LLMEngine, windowed batches that run to completion
  static      LLMEngine, fixed batches of max_batch_size in arrival order
  hf-static   transformers `generate` on left-padded batches of max_batch_size in arrival order; each batch
              runs to the longest output in it (benchmarks/hf_systems.py)
  hf-cb       transformers' continuous batching manager (benchmarks/hf_systems.py)

Every LLMEngine run gets a fresh scheduler and block pool over the same ModelRunner (weights and KV
memory), with the same limits for every policy (see `engine_settings`). Requests ignore EOS, so each
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

from benchmarks.run_result import RequestRecord, RunResult, compute_metrics
from benchmarks.trace import Trace, TraceConfig, generate_trace, max_request_len
from worker.config import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner

log = logging.getLogger(__name__)

ENGINE_POLICIES = ("continuous", "dynamic", "static")
HF_SYSTEMS = ("hf-static", "hf-cb")
ALL_SYSTEMS = ENGINE_POLICIES + HF_SYSTEMS

# Shared by every system (transformers' ones take the equivalents): documented in benchmarks/README.md.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 512
MAX_BATCH_SIZE = 16
BLOCK_SIZE = 16
KV_CACHE_BYTES = 256 * 1024**2


def engine_settings(policy: str, max_model_len: int, **overrides) -> EngineSettings:
    """Identical limits for every policy; prefix caching off (random prompts share nothing anyway, and a
    repeated trace must not hit the previous repetition's cache)."""
    values = dict(
        policy=policy, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_batch_size=MAX_BATCH_SIZE, block_size=BLOCK_SIZE, kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=max_model_len, enable_prefix_caching=False, device="cpu", dtype="float32",
    )
    values.update(overrides)
    return EngineSettings(**values)


def min_token_id(tokenizer) -> int:
    """First id above every special token: prompts are drawn from the ordinary vocabulary."""
    return max(tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder)) + 1


# ---- LLMEngine replay ---------------------------------------------------------------------------------


def _sleep_until(deadline: float | None, cap: float = 0.05) -> None:
    delay = cap if deadline is None else min(cap, deadline - time.monotonic())
    if delay > 0:
        time.sleep(delay)


def run_engine(engine: LLMEngine, trace: Trace, system: str) -> RunResult:
    requests = trace.requests
    records = {r.request_id: RequestRecord(r.request_id, r.kind, r.priority, r.arrival_s, r.num_prompt_tokens)
               for r in requests}
    scheduler, block_size = engine.scheduler, engine.scheduler.block_size
    kv_util, kv_usage, max_running = [], [], 0
    start = time.monotonic()
    num_added, flushed = 0, False
    while True:
        now = time.monotonic()
        while num_added < len(requests) and start + requests[num_added].arrival_s <= now:
            r = requests[num_added]
            sampling = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
            for out in engine.add_request(EngineRequest(r.request_id, prompt_token_ids=r.prompt_token_ids,
                                                        sampling=sampling, priority=r.priority,
                                                        arrival_time=start + r.arrival_s)):
                records[out.request_id].error = out.error_code or out.finish_reason
            num_added += 1
        next_arrival = start + requests[num_added].arrival_s if num_added < len(requests) else None
        if next_arrival is None and not flushed:
            engine.set_input_ended()  # static: the trace is over, a partial last batch may start
            flushed = True
        if not engine.has_unfinished():
            if next_arrival is None:
                break
            _sleep_until(next_arrival, cap=1.0)
            continue
        steps_before = engine.num_steps
        for out in engine.step():
            record = records[out.request_id]
            if out.finished:
                record.num_output_tokens = out.num_output_tokens
                record.first_token_s = None if out.first_token_time is None else out.first_token_time - start
                record.finish_s = out.finish_time - start
                if out.finish_reason not in ("length", "stop"):
                    record.error = out.error_code or out.finish_reason
        if engine.num_steps == steps_before:  # nothing runnable: a batch still forming
            wakes = [t for t in (engine.wake_time(), next_arrival) if t is not None]
            _sleep_until(min(wakes) if wakes else None)
            continue
        running = scheduler.running
        max_running = max(max_running, len(running))
        held = sum(r.num_computed_tokens for r in running)
        allocated = sum(len(r.block_ids) for r in running) * block_size
        if allocated:
            kv_util.append(held / allocated)
        kv_usage.append(scheduler.kv_usage)
    wall = time.monotonic() - start
    stats = engine.stats()
    return RunResult(system, trace.config.rate, list(records.values()), wall, kv_util, kv_usage, max_running,
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

    execute = runner.execute
    forward_s: list[float] = []

    def timed_execute(model_input):
        t0 = time.perf_counter()
        try:
            return execute(model_input)
        finally:
            forward_s.append(time.perf_counter() - t0)

    runner.execute = timed_execute
    step_s = []
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            assert engine.scheduler.num_running == num_seqs
    finally:
        del runner.execute  # back to the class method
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


def bench_max_model_len(profile: str) -> int:
    """The engine's max_model_len: a power of two (at least 1024) that the profile's longest request fits;
    it is also what a contiguous-cache system would reserve per request."""
    return max(1024, 1 << (max_request_len(profile) - 1).bit_length())


def set_threads(threads: int | None) -> int:
    """torch intra-op threads for every system. None: one thread when the machine is already oversubscribed
    (1-minute load >= cores: OpenMP workers then spin against other processes and a step slows ~8x), else
    torch's default."""
    import os

    import torch

    if threads is None:
        threads = 1 if os.getloadavg()[0] >= (os.cpu_count() or 1) else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def load_runner(model: str, profile: str) -> ModelRunner:
    return ModelRunner(model, engine_settings("continuous", bench_max_model_len(profile)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
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
    parser.add_argument("--threads", type=int, help="torch threads (default: see set_threads)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"torch threads: {set_threads(args.threads)}", flush=True)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")
    runner = load_runner(args.model, args.profile)
    if args.trace:
        trace = Trace.load(args.trace)
    else:
        trace = generate_trace(TraceConfig(rate=args.rate, num_requests=args.num_requests, profile=args.profile,
                                           seed=args.seed, min_token_id=min_token_id(runner.tokenizer),
                                           vocab_size=runner.vocab_size))
    results = {"runs": [], "kv_capacity": None, "overhead": None}
    hf = None
    for system in systems:
        if system in ENGINE_POLICIES:
            run = run_engine_policy(runner, system, trace)
        else:
            from benchmarks.hf_systems import HFBaselines

            hf = hf or HFBaselines(runner.model_path)
            run = hf.run(system, trace)
        metrics = compute_metrics(run)
        results["runs"].append(metrics)
        print(format_run(metrics), flush=True)
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
