"""Decode step time on the CPU with a mix of short and long contexts: the torch attention backend's grouped
decode (rows cut into padded groups of similar context length) against one group padded to the longest
context of the step (`decode_padding=inf`, how the backend worked before).

    .venv/bin/python -m benchmarks.probes.bench_decode_attention --num-seqs 64 --steps 8 --reps 3 --threads 1

Requests get prompt lengths drawn from the report's `cpu` profile (80% short: 16-64 tokens, 20% long:
128-384), are prefilled, then whole decode steps (everything in `LLMEngine.step`, the model included) are
timed. The two settings alternate (ABAB...) on the same running requests' shapes, so machine-load drift
hits both; medians with min and max over repetitions, and their ratio, are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib.settings import DEFAULT_MODEL, bench_max_model_len, engine_settings, set_threads
from benchmarks.lib.stats import median_min_max
from benchmarks.lib.trace import PROFILES
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner
from worker.model.torch_attention import DECODE_PADDING, TorchAttention


def prompt_lengths(num_seqs: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    classes = PROFILES["cpu"]
    picks = rng.choices(classes, weights=[c.weight for c in classes], k=num_seqs)
    return [rng.randint(*c.prompt_len) for c in picks]


def decode_step_times(runner, lengths: list[int], padding: float, steps: int, seed: int) -> list[float]:
    backend = TorchAttention(decode_padding=padding)
    runner.backend = runner.model.backend = backend
    settings = engine_settings("continuous", runner.max_model_len, max_num_seqs=len(lengths))
    engine = LLMEngine(settings, runner=runner)
    rng = random.Random(seed)
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(17, runner.vocab_size) for _ in range(n)]
        engine.add_request(EngineRequest(f"d{i}", prompt_token_ids=prompt,
                                         sampling=SamplingParams(max_new_tokens=steps + 64, ignore_eos=True)))
    while not (engine.scheduler.num_running == len(lengths)
               and all(r.num_output_tokens >= 2 for r in engine.scheduler.running)):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for i in range(len(lengths)):
        engine.abort([f"d{i}"])
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    # Room for every request's context: the bench's usual 256 MiB holds ~5,800 tokens.
    runner = ModelRunner(args.model, engine_settings("continuous", bench_max_model_len("cpu"), kv_cache_bytes=1024**3))
    lengths = prompt_lengths(args.num_seqs, args.seed)
    settings = {"grouped": DECODE_PADDING, "one padded group": math.inf}
    medians: dict[str, list[float]] = {name: [] for name in settings}
    for rep in range(args.reps):
        for name, padding in settings.items():
            times = decode_step_times(runner, lengths, padding, args.steps, args.seed + rep)
            medians[name].append(statistics.median(times))
            print(f"rep {rep + 1}/{args.reps} {name}: median step {medians[name][-1] * 1e3:.0f} ms", file=sys.stderr)
    result = {
        "num_seqs": args.num_seqs, "threads": threads, "steps": args.steps, "reps": args.reps,
        "context_tokens": sum(lengths), "longest_context": max(lengths),
        "step_s": {name: median_min_max(values) for name, values in medians.items()},
        "speedup": statistics.median(medians["one padded group"]) / statistics.median(medians["grouped"]),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
