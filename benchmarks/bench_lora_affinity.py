"""Adapter loads on a fleet that holds fewer adapters than its traffic asks for, with and without routing by
adapter.

Two `llm-worker serve` on the default model, each holding at most `--max-loras` adapters (ENGINE_MAX_LORAS), a
folder of `--num-adapters` rank-`--rank` adapters (PEFT's layout, random weights) shared by both. `--requests`
short requests (a prompt of a few words, `--max-new-tokens`, EOS ignored) at priority 1, each naming an adapter
drawn at random: uniformly (`--zipf 0`) or by a Zipf law of exponent `--zipf` (adapter k with weight 1/k^s, as
real fleets see a few popular fine-tunes and a long tail). They go out in waves of `--wave` and each wave is
answered before the next, so both runs see the same batches; with `--backlog` they all go at once, and each
worker's scheduler picks from its queue (a request whose adapter would be one more than ENGINE_MAX_LORAS among
the running ones waits while other adapters' go on, and with every slot taken one whose adapter is not loaded
lets those of loaded ones go first for up to `--resident-first-steps` steps). Two runs on fresh workers and
topics, the same draws:

  affinity  the wire's routing key: a request naming an adapter goes to that adapter's partition of its
            priority, so to the worker that owns it (schemas/priority.py);
  spread    the partition picked by the request id, as before routing by adapter: every worker sees every
            adapter.

Per run: adapter loads per 1,000 requests (the workers' `num_adapter_loads` on the status topic, reloads after
an eviction included), the requests each worker served, their wait before their first step (queue_ms: p50,
p90, max), the wall time. The floor: affinity's loads per 1,000
at most half of spread's. The partitions per priority and their split over the two workers decide how the
adapters divide; the summary gives how many adapters each worker served.

    .venv/bin/python -m benchmarks.bench_lora_affinity --zipf 1.0
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from schemas.request import GenerationRequest, SamplingSpec
from benchmarks.lib.worker_fleet import REPO, Run

FLOOR_RATIO = 0.5


def write_adapters(folder: Path, num: int, rank: int) -> list[str]:
    from benchmarks.bench_lora import write_adapter
    from worker.model.config import load_config
    from worker.model.pull import ensure_default_model

    config = load_config(ensure_default_model())
    names = [f"ft-{k:02d}" for k in range(num)]
    for k, name in enumerate(names):
        write_adapter(folder / name, config, rank, seed=k)
    return names


def draws(names: list[str], num: int, zipf: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(len(names))]
    return rng.choices(names, weights, k=num)


async def one_run(bootstrap: str, tmp: Path, name: str, adapters_dir: Path, picks: list[str],
                  a: argparse.Namespace) -> dict:
    env = {"ENGINE_ADAPTERS_DIR": str(adapters_dir), "ENGINE_MAX_LORAS": str(a.max_loras),
           "ENGINE_MAX_NUM_SEQS": str(a.wave), "WORKER_MAX_QUEUE_TIME_S": "[0, 0, 0]",
           "ENGINE_LORA_RESIDENT_FIRST_STEPS": str(a.resident_first_steps)}
    started = time.monotonic()
    async with Run(bootstrap, tmp, name, env, ["--engine", "llm"], 2) as run:
        before = sum(s.num_adapter_loads or 0 for s in run.statuses.values())
        adapter_of: dict[str, str] = {}
        size = len(picks) if a.backlog else a.wave
        for first in range(0, len(picks), size):
            wave = [GenerationRequest(id=f"{name}-{i}-{uuid.uuid4().hex[:10]}", prompt=f"Item {i}: say hello.",
                                      model=adapter, max_new_tokens=a.max_new_tokens,
                                      sampling=SamplingSpec(ignore_eos=True))
                    for i, adapter in enumerate(picks[first:first + size], start=first)]
            for request in wave:
                adapter_of[request.id] = request.model
                await run.send(request, key=None if name == "affinity" else request.id)
            await run.producer.flush()
            await run.wait_for([r.id for r in wave], 600)
        await asyncio.sleep(2 * 0.5 + 0.5)  # a status record after the last final, from each worker
        loads = sum(s.num_adapter_loads or 0 for s in run.statuses.values()) - before
        served = Counter(f.worker_id for f in run.finals.values())
        completed = sum(f.status == "completed" for f in run.finals.values())
        waits = sorted(f.timings.queue_ms for f in run.finals.values() if f.timings.queue_ms is not None)
        adapters_seen: dict[str, set[str]] = {}
        for f in run.finals.values():
            adapters_seen.setdefault(f.worker_id, set()).add(adapter_of[f.id])
    return {"run": name, "requests": len(picks), "completed": completed, "adapter_loads": loads,
            "loads_per_1000": round(1000 * loads / len(picks), 1), "served_by_worker": dict(served),
            "adapters_by_worker": {w: len(seen) for w, seen in sorted(adapters_seen.items())},
            "queue_ms_p50_p90_max": [round(waits[int(q * (len(waits) - 1))]) for q in (0.5, 0.9, 1.0)] if waits
            else None,
            "seconds": round(time.monotonic() - started, 1)}


async def amain(a: argparse.Namespace) -> dict:
    from benchmarks.bench_kafka_path import kafka_session

    with kafka_session(a.bootstrap, prefix="bench-lora-affinity-") as session, \
            tempfile.TemporaryDirectory(prefix="adapters-") as folder:
        names = write_adapters(Path(folder), a.num_adapters, a.rank)
        picks = draws(names, a.requests, a.zipf, a.seed)
        runs = {}
        for name in ("affinity", "spread"):
            runs[name] = await one_run(session.bootstrap, session.tmp, name, Path(folder), picks, a)
            print(json.dumps(runs[name]), flush=True)
    ratio = runs["affinity"]["loads_per_1000"] / max(runs["spread"]["loads_per_1000"], 1e-9)
    summary = {"runs": runs, "affinity_over_spread": round(ratio, 3), "floor": FLOOR_RATIO,
               "floor_met": ratio <= FLOOR_RATIO, "zipf": a.zipf, "num_adapters": a.num_adapters,
               "max_loras": a.max_loras, "resident_first_steps": a.resident_first_steps,
               "command": "python -m benchmarks.bench_lora_affinity " + " ".join(a.argv),
               "load_average": [round(x, 2) for x in os.getloadavg()]}
    date = datetime.date.today().isoformat()
    out = REPO / "benchmarks" / "results" / (f"{date}-lora-affinity" + (f"-{a.label}" if a.label else ""))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["written_to"] = str(out)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default=None, help="a running broker (default: a local one on free ports)")
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--wave", type=int, default=16, help="requests in flight at once (and engine seats)")
    p.add_argument("--backlog", action="store_true",
                   help="send every request at once (a backlog; the engine still seats --wave), not in waves")
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--resident-first-steps", type=int, default=32,
                   help="ENGINE_LORA_RESIDENT_FIRST_STEPS: how long a request may let those of loaded adapters go "
                        "first (0: arrival order)")
    p.add_argument("--zipf", type=float, default=1.0, help="0: every adapter alike")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    print(json.dumps(asyncio.run(amain(a)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
