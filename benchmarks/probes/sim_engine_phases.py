"""Where the engine's host time goes on the simulated GPU (issue #16): the engine alone, as bench_sim_kafka's
"engine alone" runs it (the same trace and settings), with each phase of its step timed from outside, and the
host time between the moment a forward is done and the launch of the next (what the device waits for).

    .venv/bin/python -m benchmarks.probes.sim_engine_phases                      # 8B@256, async scheduling on and off
    .venv/bin/python -m benchmarks.probes.sim_engine_phases --point llama-3.1-8b@64 --modes on

Prints, per mode: wall and simulated seconds and their ratio (the engine alone ÷ the forward-only ceiling, as
in bench_sim_kafka), ms per step of each phase, and the median gap between a forward's end and the next launch.
Phases overlap the device with async scheduling on, so they do not add up to the step.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from benchmarks.bench_engine import run_engine
from benchmarks.bench_sim_kafka import parse_point, sim_settings, sim_trace
from benchmarks.lib.settings import min_token_id, set_threads
from worker.engine.engine import LLMEngine
from worker.model.sim import SimRunner


def _timed(obj, name: str, totals: collections.Counter, key: str) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def measure(point: str, mode: str, max_num_batched_tokens: int) -> dict:
    model, running = parse_point(point)
    settings = sim_settings(model, running, max_num_batched_tokens, "sim:h200", mode)
    runner = SimRunner(settings)
    tokenizer = runner.tokenizer
    low, vocab = min_token_id(tokenizer), len(tokenizer)
    run_engine(LLMEngine(settings, runner=runner), sim_trace(16, 1, low, vocab), "warm-up")
    runner.reset()
    engine = LLMEngine(settings, runner=runner)
    totals: collections.Counter = collections.Counter()
    for obj, name, key in ((engine, "_schedule", "schedule"), (runner, "prepare_arrays", "prepare arrays"),
                           (engine.sampler, "sample_step", "sample"), (engine.scheduler, "update", "update"),
                           (engine, "_postprocess_step", "detokenize"), (runner, "_wait_until", "device wait")):
        _timed(obj, name, totals, key)
    gaps: list[float] = []
    ready = [None]
    wait, launch = runner._wait_until, runner.launch

    def wait_until(ready_at: float) -> None:
        wait(ready_at)
        ready[0] = time.perf_counter()

    def timed_launch(model_input):
        if ready[0] is not None:
            gaps.append(time.perf_counter() - ready[0])
            ready[0] = None
        return launch(model_input)

    runner._wait_until, runner.launch = wait_until, timed_launch
    simulated_before = runner.simulated_s
    start = time.perf_counter()
    run_engine(engine, sim_trace(2 * running, 0, low, vocab), "engine")
    wall = time.perf_counter() - start
    simulated = runner.simulated_s - simulated_before
    steps = max(1, engine.num_steps)
    return {"point": point, "mode": mode, "wall_s": wall, "simulated_s": simulated, "steps": steps,
            "ratio": simulated / wall, "ms_per_step": {k: 1e3 * v / steps for k, v in totals.most_common()},
            "gap_ms_median": 1e3 * statistics.median(gaps) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", default="llama-3.1-8b@256")
    parser.add_argument("--modes", default="on,off", help="ENGINE_ASYNC_SCHEDULING values, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    set_threads(1)
    for mode in args.modes.split(","):
        r = measure(args.point, mode, args.max_num_batched_tokens)
        print(f"{r['point']} async scheduling {mode}: wall {r['wall_s']:.2f} s, simulated {r['simulated_s']:.2f} s, "
              f"engine alone / ceiling {r['ratio']:.3f}, {r['steps']} steps; forward done -> next launch "
              f"{r['gap_ms_median']:.3f} ms (median)")
        print("  ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ms_per_step"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
