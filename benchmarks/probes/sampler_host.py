"""The sampler's host work per step without its array math: `Sampler.sample_step` at [R, V] with
the CPU draw (worker/model/sampler_numpy.py `draw`) replaced by a constant, i.e. what is left of sampling on the
host when a GPU does the draw (issue #16). Also times the step with the real CPU draw, for scale.

Run it in two source trees alternately to compare versions (the machine's speed drifts within minutes):

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for t in /tmp/before .; do
        (cd $t && PYTHONPATH=. python -m benchmarks.probes.sampler_host); done; done
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from worker.model import sampler as sampler_module
from worker.model import sampler_numpy

SAMPLINGS = {"t0.8": dict(temperature=0.8), "t0.8-k50-p0.9": dict(temperature=0.8, top_k=50, top_p=0.9)}


def median_us(fn, iterations: int) -> float:
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e6 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--sampling", choices=list(SAMPLINGS), default="t0.8-k50-p0.9")
    parser.add_argument("--iterations", type=int, default=3000, help="steps without the draw (400 with it)")
    parser.add_argument("--churn", action="store_true",
                        help="at every step one request finishes and another starts (the rows shift by one), as "
                             "in a busy engine: the sampler cannot reuse the last step's parameters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Every row sampled and seeded, as the engine seeds every sampled request; a new counter at every step.
    params = [sampler_module.RowSampling(seed=1234 + i, **SAMPLINGS[args.sampling]) for i in range(args.rows)]
    logits = 3.0 * torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    sampler = sampler_module.Sampler()
    step_index = [0]

    def step() -> None:
        step_index[0] += 1
        if args.churn:
            params.append(sampler_module.RowSampling(seed=10**6 + step_index[0], **SAMPLINGS[args.sampling]))
            del params[0]
        counters = [step_index[0] + i for i in range(args.rows)]
        sampler.sample_step(logits, params, counters)

    real_draw = sampler_numpy.draw
    drawn = np.zeros(args.rows, dtype=np.int64)
    sampler_numpy.draw = lambda *a, **k: drawn
    try:
        without = median_us(step, args.iterations)
    finally:
        sampler_numpy.draw = real_draw
    with_draw = median_us(step, max(1, args.iterations // 8))
    print(json.dumps({"tree": str(Path.cwd()), "rows": args.rows, "vocab": args.vocab, "sampling": args.sampling,
                      "churn": args.churn, "host_us_without_draw": round(without, 1),
                      "us_with_cpu_draw": round(with_draw, 1),
                      "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
