"""The scheduler's host work per decode step while many requests wait (issue #16): `schedule()` + `update()` with
fake sampled tokens + `num_waiting_by_priority()` (what the engine thread reports after every step), R running
and W waiting behind a full set of seats, with a fitted step-time model so the deadline arithmetic runs.

Run it in two source trees alternately to compare versions (the machine's speed drifts within minutes):

    for i in 1 2 3; do for t in /tmp/before .; do
        (cd $t && PYTHONPATH=. python -m benchmarks.probes.scheduler_waiting)
    done; done
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from worker.model.settings import EngineSettings
from worker.engine.api import SamplingParams
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", default="256,4096", help="comma-separated numbers of waiting requests")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="every request's deadline, seconds ahead (default none); priorities 0 and 1 with a "
                             "deadline are walked by the deadline-aware step budget at every step")
    args = parser.parse_args()
    for num_waiting in [int(x) for x in args.waiting.split(",")]:
        settings = EngineSettings(max_num_seqs=args.running, max_num_batched_tokens=8192, max_model_len=4096,
                                  block_size=16, enable_prefix_caching=False)
        scheduler = Scheduler(settings, num_blocks=args.running * 64 + 64, max_model_len=4096)
        sampling = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        deadline = None if args.deadline_s is None else 1000.0 + args.deadline_s
        for i in range(args.running + num_waiting):
            scheduler.add_request(Request(f"r{i}", list(range(100, 132)), sampling, priority=i % 3,
                                          arrival_time=float(i), deadline=deadline))
        now, step_cost = 1000.0, (0.01, 1e-5)
        while any(r.num_output_tokens == 0 for r in scheduler.running) or len(scheduler.running) < args.running:
            output = scheduler.schedule(now, step_cost)
            scheduler.update(output, {e.request_id: 7 for e in output.scheduled if e.samples}, now)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            output = scheduler.schedule(now, step_cost)
            scheduler.update(output, {e.request_id: 7 for e in output.scheduled if e.samples}, now)
            scheduler.num_waiting_by_priority()
            times.append(time.perf_counter() - start)
            now += 0.01
        assert len(scheduler.running) == args.running and scheduler.num_waiting == num_waiting
        times.sort()
        print(json.dumps({"tree": str(Path.cwd()), "running": args.running, "waiting": num_waiting,
                          "deadline_s": args.deadline_s, "us_per_step_median": round(1e6 * times[len(times) // 2], 1),
                          "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
