"""The simulated accelerator's step times, and how much of a real engine step on it is host work.

Two tables:
1. roofline: decode step of N running requests with C tokens of context each, per device and model shape
   (worker/model/sim.py's `step_cost`: memory time, compute time, launch cost, total);
2. engine: LLMEngine on the simulated device (real sleeps), N requests decoding after a prompt of C tokens:
   wall time per decode step (real waits), the simulated device time in it, the host work (the same steps
   with the waits skipped; today's engine serializes it with the device) and the share of the wall time the
   device is busy, for greedy and temperature 0.8 + top-k 50 + top-p 0.9. A sleep wakes up late by tens of
   microseconds or more on a loaded machine: wall - device - host.

    .venv/bin/python -m benchmarks.probes.sim_profiles    # both tables, JSON to results/<date>-sim-profiles/
    .venv/bin/python -m benchmarks.probes.sim_profiles --runs 64 --models llama-3.1-8b --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.settings import DEFAULT_MODEL, set_threads
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.sim import DEVICES, ModelShape, SimRunner, sim_config, step_cost
from worker.model.pull import resolve_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
SAMPLINGS = {"greedy": dict(temperature=0.0), "t0.8-k50-p0.9": dict(temperature=0.8, top_k=50, top_p=0.9)}


def roofline_rows(devices: list[str], models: list[str], runs: list[int], context: int) -> list[dict]:
    rows = []
    for model in models:
        shape = ModelShape.of(sim_config(model, Path(".")))
        for device in devices:
            for n in runs:
                cost = step_cost(shape, DEVICES[device], np.ones(n), np.full(n, context), n)
                rows.append({"device": device, "model": model, "num_running": n, "context": context,
                             "ms": 1e3 * cost.seconds, "memory_ms": 1e3 * cost.memory_s,
                             "compute_ms": 1e3 * cost.compute_s, "launch_ms": 1e3 * cost.launch_s,
                             "gb_moved": cost.bytes / 1e9, "tflop": cost.flops / 1e12})
    return rows


def engine_row(model: str, device: str, n: int, context: int, sampling: str, steps: int) -> dict:
    settings = EngineSettings(
        model=str(resolve_model(DEFAULT_MODEL)), device=f"sim:{device}", sim_model=model, max_num_seqs=n,
        max_num_batched_tokens=8192, max_model_len=context + 2 * steps + 64 + n * context // 8192,
        enable_prefix_caching=False,
    )
    runner = SimRunner(settings)
    engine = LLMEngine(settings, runner)
    # Room for the decode steps the first requests take while the last ones are still prefilling.
    params = SamplingParams(max_new_tokens=2 * steps + 32 + n * context // 8192, ignore_eos=True,
                            **SAMPLINGS[sampling])
    for i in range(n):
        prompt = [100 + (i * 37 + j * 11) % 40000 for j in range(context)]
        engine.add_request(EngineRequest(f"s{i}", prompt_token_ids=prompt, sampling=params))
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step pays first-use costs
    # Host work alone: the same steps with the waits skipped (the runner's own work, a few tens of µs for the
    # cost and the logits, would overlap the device and is included: an upper bound).
    real_sleep, runner._sleep = runner._sleep, lambda seconds: None
    host = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - start)
    runner._sleep = real_sleep
    walls, simulated = [], []
    for _ in range(steps):
        before = runner.simulated_s
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        simulated.append(runner.simulated_s - before)
    assert engine.scheduler.num_running == n, "a request finished during the measurement"
    wall, device_s, host_s = statistics.median(walls), statistics.median(simulated), statistics.median(host)
    return {"device": device, "model": model, "num_running": n, "context": context, "sampling": sampling,
            "wall_ms": 1e3 * wall, "device_ms": 1e3 * device_s, "host_ms": 1e3 * host_s,
            "device_busy": device_s / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="h200,h100")
    parser.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--runs", default="16,64,256")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per request")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per engine point")
    parser.add_argument("--engine-devices", default="h200", help="devices of the engine table ('' skips it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    devices, models = args.devices.split(","), args.models.split(",")
    runs = [int(x) for x in args.runs.split(",")]
    load = os.getloadavg()
    roofline = roofline_rows(devices, models, runs, args.context)
    print(f"roofline, decode, {args.context} tokens of context per request")
    print(f"{'device':>6} {'model':>14} {'running':>7} {'ms':>7} {'memory':>7} {'compute':>7} {'launch':>6}")
    for r in roofline:
        print(f"{r['device']:>6} {r['model']:>14} {r['num_running']:>7} {r['ms']:>7.3f} {r['memory_ms']:>7.3f} "
              f"{r['compute_ms']:>7.3f} {r['launch_ms']:>6.3f}")
    engine = []
    engine_devices = [d for d in args.engine_devices.split(",") if d]
    if engine_devices:
        print(f"\nengine on the simulated device (threads={threads}, loadavg {load[0]:.2f}): median decode step")
        print(f"{'device':>6} {'model':>14} {'sampling':>14} {'running':>7} {'wall ms':>8} {'device':>7} "
              f"{'host':>6} {'busy':>5}")
    for device in engine_devices:
        for model in models:
            for sampling in SAMPLINGS:
                for n in runs:
                    r = engine_row(model, device, n, args.context, sampling, args.steps)
                    engine.append(r)
                    print(f"{device:>6} {model:>14} {sampling:>14} {n:>7} {r['wall_ms']:>8.2f} "
                          f"{r['device_ms']:>7.2f} {r['host_ms']:>6.2f} {r['device_busy']:>5.0%}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"{datetime.date.today().isoformat()}-sim-profiles"
    out.mkdir(parents=True, exist_ok=True)
    record = {"threads": threads, "loadavg_before": load, "loadavg_after": os.getloadavg(),
              "context": args.context, "roofline": roofline, "engine": engine}
    (out / "sim_profiles.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'sim_profiles.json'}")


if __name__ == "__main__":
    main()
