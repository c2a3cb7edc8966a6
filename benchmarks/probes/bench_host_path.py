"""Host work per engine step with the forward removed: what is left of a step when the device is infinitely fast.

The real `LLMEngine` runs (scheduler, block pool, batch building, the runner's input tensors, sampler,
scheduler update, detokenizer), but the model runner's `execute` returns rows of a precomputed
[max rows, V] float32 logits tensor instead of running the model. N requests are admitted and prefilled,
then every step is a pure decode step of N rows; the timed steps are decode steps only, after a warm-up.
Requests ignore EOS and have room for every step, so N stays constant.

Sampling configurations: greedy; temperature 0.8; temperature 0.8 with top_k 50 and top_p 0.9. V = 2048 (as
in issue #16's table) and the real vocabulary (49152). Logits live on the CPU here: on a GPU the sampler's
tensor math runs on the device, so at V = 49152 the CPU columns overstate host work by that math.

    # a table, and results/<date>-host-path/baseline.json:
    .venv/bin/python -m benchmarks.probes.bench_host_path --label baseline
    .venv/bin/python -m benchmarks.probes.bench_host_path --runs 16,64 --vocabs 2048 --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib.settings import DEFAULT_MODEL, set_threads
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.memory import freeze_startup_objects
from worker.model import sampler_numpy
from worker.model.runner import ModelRunner

RESULTS = Path(__file__).resolve().parents[1] / "results"
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "t0.8": dict(temperature=0.8),
    "t0.8-k50-p0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
}
PROMPT_LEN = 32
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def make_runner(model: str, max_running: int, device: str) -> ModelRunner:
    # bf16 halves the (unused) KV cache; the forward never runs, so its dtype is irrelevant to the timings.
    blocks_per_request = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    settings = EngineSettings(
        model=model, device=device, dtype="bfloat16" if device == "cpu" else "auto", block_size=BLOCK_SIZE,
        num_kv_blocks=max_running * blocks_per_request + 8, max_model_len=MAX_MODEL_LEN,
    )
    return ModelRunner(model, settings)


def remove_forward(runner: ModelRunner, logits: torch.Tensor) -> None:
    """runner.execute returns the first S rows of `logits` ([max rows, V]), S = rows that sample this step."""

    def execute(model_input, **_) -> torch.Tensor:
        return logits[: model_input.logits_indices.shape[0]]

    runner.execute = execute


def engine_for(runner: ModelRunner, num_running: int) -> LLMEngine:
    settings = EngineSettings(
        model=str(runner.model_path), device=runner.settings.device, block_size=BLOCK_SIZE,
        max_num_seqs=num_running, max_num_batched_tokens=max(512, num_running * PROMPT_LEN),
        max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
    )
    engine = LLMEngine(settings, runner)
    freeze_startup_objects()  # as the worker does once its engine is built (worker/serve.py)
    return engine


def requests(num: int, sampling: dict, num_steps: int, vocab: int) -> list[EngineRequest]:
    params = SamplingParams(max_new_tokens=num_steps, ignore_eos=True, **sampling)
    return [
        EngineRequest(f"h{i}", prompt_token_ids=[100 + (i * 37 + j * 11) % (vocab - 100) for j in range(PROMPT_LEN)],
                      sampling=params)
        for i in range(num)
    ]


class PhaseTimer:
    """Wraps named methods of the engine's parts and sums the time spent in each (found by name, so the
    breakdown survives refactoring: a phase whose method is gone is simply not reported). `draw` is the CPU
    draw's array math inside `sample` (worker/model/sampler_numpy.py): on a GPU it runs on the device (the
    sampler's torch operations queue behind the forward), so step - draw is this CPU's host work of the GPU
    regime, less the launches of those operations (not measurable here)."""

    PHASES = (
        ("schedule", "scheduler", "schedule"),
        ("prepare_input", "runner", "prepare_input"),
        ("sample", "sampler", "sample_step"),
        ("draw", "sampler_numpy", "draw"),
        ("update", "scheduler", "update"),
        ("postprocess", "engine", "_postprocess_step"),
        ("postprocess", "engine", "_postprocess"),
    )

    def __init__(self, engine: LLMEngine) -> None:
        self.totals: dict[str, float] = {}
        self.active = False
        self._wrapped: list[tuple[object, str, object]] = []
        for phase, owner_name, method in self.PHASES:
            owner = ({"engine": engine, "sampler_numpy": sampler_numpy}.get(owner_name)
                     or getattr(engine, owner_name, None))
            if owner is None or not hasattr(owner, method) or phase in self.totals:
                continue
            self.totals[phase] = 0.0
            self._wrapped.append((owner, method, getattr(owner, method)))
            setattr(owner, method, self._wrap(phase, getattr(owner, method)))

    def close(self) -> None:
        """Unwrap (the draw is a module function, shared by every engine of the run)."""
        for owner, method, original in reversed(self._wrapped):
            setattr(owner, method, original)

    def _wrap(self, phase, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        return timed


def measure(runner: ModelRunner, num_running: int, sampling: dict, vocab: int, num_steps: int, warmup: int) -> dict:
    engine = engine_for(runner, num_running)
    timer = PhaseTimer(engine)
    for request in requests(num_running, sampling, num_steps + warmup + 4, vocab):
        assert engine.add_request(request) == []
    engine.set_input_ended()
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # admission and prefill
    for _ in range(warmup):
        engine.step()
    assert engine.scheduler.num_running == num_running
    times = []
    timer.active = True
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == num_running and not any(o.finished for o in outputs)
    timer.active = False
    timer.close()
    engine.abort(list(engine.scheduler.requests))
    median = statistics.median(times)
    return {
        "num_running": num_running, "vocab": vocab, "sampling": sampling,
        "ms_per_step_median": 1e3 * median, "ms_per_step_mean": 1e3 * statistics.fmean(times),
        "ms_per_step_min": 1e3 * min(times), "us_per_request": 1e6 * median / num_running,
        "phases_ms_per_step": {k: 1e3 * v / num_steps for k, v in timer.totals.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", default="16,64,256", help="running requests per step")
    parser.add_argument("--vocabs", default="2048,49152", help="logits widths")
    parser.add_argument("--samplings", default=",".join(SAMPLINGS))
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per point")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: benchmarks.lib.settings's rule)")
    parser.add_argument("--label", default="run", help="JSON file name under the results folder")
    parser.add_argument("--out", default=None, help=f"results folder (default {RESULTS}/<date>-host-path)")
    args = parser.parse_args()

    threads = set_threads(args.threads)
    runs = [int(x) for x in args.runs.split(",")]
    vocabs = [int(x) for x in args.vocabs.split(",")]
    samplings = args.samplings.split(",")
    runner = make_runner(args.model, max(runs), args.device)
    max_rows = max(runs)
    points = []
    load_before = os.getloadavg()
    print(f"threads={threads} loadavg={load_before}")
    print(f"{'V':>6} {'sampling':>14} {'running':>7} {'ms/step':>8} {'us/req':>7}  phases (ms/step)")
    for vocab in vocabs:
        logits = 3.0 * torch.randn(max_rows, vocab, generator=torch.Generator().manual_seed(0))
        if runner.device.type != "cpu":
            logits = logits.to(runner.device)
        remove_forward(runner, logits)
        for name in samplings:
            for num_running in runs:
                point = measure(runner, num_running, SAMPLINGS[name], vocab, args.steps, args.warmup)
                point["sampling_name"] = name
                points.append(point)
                phases = " ".join(f"{k}={v:.2f}" for k, v in point["phases_ms_per_step"].items())
                print(f"{vocab:>6} {name:>14} {num_running:>7} {point['ms_per_step_median']:>8.2f} "
                      f"{point['us_per_request']:>7.1f}  {phases}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"{datetime.date.today().isoformat()}-host-path"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "label": args.label, "model": args.model, "device": args.device, "threads": threads,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "steps": args.steps,
        "warmup": args.warmup, "prompt_len": PROMPT_LEN, "points": points,
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    (out / f"{args.label}.json").write_text(json.dumps(record, indent=1))
    print(f"loadavg after: {record['loadavg_after']}; wrote {out / (args.label + '.json')}")


if __name__ == "__main__":
    main()
