"""Tenants and sessions through the real broker: fair share under a flood, and conversations that find their
cache on a fleet of two workers.

fairness  One `llm-worker serve --engine instant` (model-free, `--step-ms` a step, ENGINE_MAX_NUM_SEQS seats:
          a known capacity), three tenants at priority 1, the flood sending ten times each of the others, the
          total `--overload` times the capacity, for `--seconds`. Three runs, a fresh worker and topics each:
            alone  the two calm tenants only (the flood absent);
            fair   all three, each request naming its tenant;
            fcfs   the same traffic with no tenant named: one queue, first come first served.
          Per tenant: requests, completed, shed, tokens served against its max-min fair share of what the
          worker served, time to first token p50/p99. The floors: each calm tenant gets >= 90 % of its fair
          share in `fair`, with a p99 TTFT <= 1.5x its p99 in `alone`; the flood is the tenant shed. The cost
          of fair scheduling is fair's tokens/s over fcfs's.
sessions  Two `llm-worker serve` (the real model unless --model says otherwise), `--conversations`
          conversations of `--turns` turns, each turn the whole history plus a new question; the turns of all
          conversations go out together, the next turn once all have answered. Two runs: `session` (session_id
          set: the partition follows the conversation) and `request` (none: the partition follows the request
          id). Per run: the prefix-cache hit rate over prompt tokens (sum of usage.cached_tokens / sum of
          prompt_tokens), TTFT p50/p90, and the share of turns served by the worker of the previous turn.
          Floor: hit rate >= 0.8 with session keys.

fleet     Two `llm-worker serve --engine fake` (8 seats, `--step-ms` a step, 10-token requests): tenant `wide`
          sends 40 requests/s over both partitions of priority 1, tenant `narrow` 20/s to one of them (so to one
          worker), for `--seconds`. Two modes, alternating `--reps` times: `fleet` (WORKER_TENANT_FLEET_SHARE on:
          each worker charges what the other served) and `per-worker` (off). Per run: narrow's share of the tokens
          completed in the second half, and the tokens by worker and tenant. The fleet's fair split is 0.5.

fleet6    Three `llm-worker serve --engine fake` (8 seats each, six partitions a priority), six tenants at
          priority 1: request sizes 5 and 100 tokens (1:20), spread over all six, two or one of the priority's
          partitions, each offering twice its share of the fleet (`--placement`: the skewed tenants' two
          partitions held by two workers, the default, or by one). Runs `fleet` (fleet share on), `per-worker`
          (off) and `fcfs` (no tenant named). Per minute after a 10 s warm-up, by tenant: its service (prompt
          and output tokens, as the fair share counts them, when they were streamed) and the output tokens of
          its requests completed in the minute; the largest gap between two tenants of each. Floors: the
          service gap <= twice the largest request (200 tokens) in every minute, at >= 95 % of fcfs's
          tokens/s.

flood     The issue's scenario on the real model (one `llm-worker serve`, default settings, priority 1): tenants
          `a` and `b` send 2 requests/s each (16 tokens, EOS ignored), `flood` 40 requests/s of 96 tokens, for
          `--seconds`. Three runs: `solo` (a and b only), `flood-alone` (the flood only: what the worker
          serves), `fair` (all three, tenants named). Tokens/s: output tokens of completed requests over the run's
          span (first send to last completion). Floors: a and b complete 100 % with an e2e p90 <= 2x their solo
          p90; the flood's tokens/s in `fair` >= 90 % of flood-alone's minus a and b's. `--scaled`: flood-alone
          runs first, and solo and fair then offer the issue's traffic in proportion to what it served (the flood
          ten times it, a and b together a sixth of it), for a worker slower or faster than the issue's.
          `--fair-step-ms X[,Y...]`: one more run each, `fair-step-X`, as `fair` with ENGINE_FAIR_STEP_MS=X (the
          flood's rows cut while a and b run, docs/tenants.md); the floors are checked for every `fair*` run.

Writes summary-<part>.json (and a plot, but for fleet) under benchmarks/results/<date>-tenants[-label]/:

    .venv/bin/python -m benchmarks.bench_tenants fairness
    .venv/bin/python -m benchmarks.bench_tenants sessions
    .venv/bin/python -m benchmarks.bench_tenants fleet --seconds 20 --step-ms 45
    .venv/bin/python -m benchmarks.bench_tenants fleet6 --seconds 130 --step-ms 45
    .venv/bin/python -m benchmarks.bench_tenants flood --seconds 40
    .venv/bin/python -m benchmarks.bench_tenants flood --seconds 30 --scaled --fair-step-ms 60,70,85
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path


from schemas.priority import partition_for
from schemas.request import ChatMessage, GenerationRequest, SamplingSpec
from schemas.result import FinalRecord
from benchmarks.lib.worker_fleet import Run

REPO = Path(__file__).resolve().parents[1]
FLOOR_SHARE = 0.9
FLOOR_TTFT_RATIO = 1.5
FLOOR_HIT_RATE = 0.8
CALM = ("calm-a", "calm-b")


def fair_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of `capacity`: water-filling, each tenant capped at its demand."""
    shares, left, waiting = {}, capacity, dict(demands)
    while waiting:
        level = left / len(waiting)
        small = {t: d for t, d in waiting.items() if d <= level}
        if not small:
            return {**shares, **dict.fromkeys(waiting, level)}
        for tenant, demand in small.items():
            shares[tenant] = demand
            left -= demand
            del waiting[tenant]
    return shares


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


# ---- fairness ------------------------------------------------------------------------------------------------


def tokens_of(tenant: str, a: argparse.Namespace) -> int:
    return a.flood_tokens if tenant == "flood" and a.flood_tokens else a.max_new_tokens


async def fairness_run(bootstrap: str, tmp: Path, name: str, a: argparse.Namespace) -> dict:
    # The mean request of the mix decides the capacity in requests/s (the flood is 10 of every 12).
    mean_tokens = (10 * tokens_of("flood", a) + 2 * a.max_new_tokens) / 12 if name != "alone" else a.max_new_tokens
    step_ms = a.step_ms + (a.max_num_seqs * a.per_seq_ms if a.engine == "fake" else 0.0)
    capacity = a.max_num_seqs * (1000.0 / step_ms) / mean_tokens  # requests/s
    rate = capacity * a.overload
    # Per 12 requests: 10 of the flood, 1 of each calm tenant; without the flood the calm ones keep their rate.
    pattern = ["flood"] * 10 + list(CALM) if name != "alone" else list(CALM)
    if name == "alone":  # the calm tenants at the rate they have beside the flood
        rate = a.max_num_seqs * (1000.0 / step_ms) / ((10 * tokens_of("flood", a) + 2 * a.max_new_tokens) / 12) \
            * a.overload * 2 / 12
    env = {"ENGINE_MAX_NUM_SEQS": str(a.max_num_seqs), "WORKER_MAX_WAITING": str(a.max_waiting),
           "WORKER_RESUME_WAITING": str(a.max_waiting // 2)}
    engine = ["--engine", "instant", "--instant-step-ms", str(a.step_ms)] if a.engine == "instant" else [
        "--engine", "fake", "--fake-step-ms", str(a.step_ms), "--fake-per-seq-ms", str(a.per_seq_ms),
        "--fake-eos-probability", "0"]
    async with Run(bootstrap, tmp, name, env, engine, 1) as run:
        sent: list[GenerationRequest] = []
        sent_at: dict[str, float] = {}
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < a.seconds:
            tenant = pattern[i % len(pattern)]
            request = GenerationRequest(id=f"{name}-{tenant}-{i}", prompt="x" * 40,
                                        max_new_tokens=tokens_of(tenant, a), tenant=tenant if name != "fcfs" else None)
            sent_at[request.id] = time.time()
            await run.send(request)
            sent.append(request)
            i += 1
            ahead = i / rate - (time.monotonic() - start)
            if ahead > 0:
                await asyncio.sleep(ahead)
        send_s = time.monotonic() - start
        await run.producer.flush()
        await run.wait_for([r.id for r in sent], 120 + a.seconds)
    # Served tokens over the span from the first send to the last completion (a backlog drains after sending).
    done_at = [sent_at[r.id] + (run.finals[r.id].timings.e2e_ms or 0) / 1000.0 for r in sent
               if run.finals[r.id].status == "completed"]
    span_s = max(done_at, default=time.time()) - min(sent_at.values())
    tenant_of = {r.id: r.id.split("-", 1)[1].rsplit("-", 1)[0] for r in sent}
    per: dict[str, dict] = {}
    asked = Counter(tenant_of.values())
    tokens = Counter()
    for rid, tenant in tenant_of.items():
        f = run.finals[rid]
        p = per.setdefault(tenant, {"sent": 0, "completed": 0, "rejected": Counter(), "ttft_ms": [], "e2e_ms": [],
                                    "queue_ms": []})
        p["sent"] += 1
        if f.status == "completed":
            p["completed"] += 1
            tokens[tenant] += f.usage.prompt_tokens + f.usage.completion_tokens
            if f.timings.ttft_ms is not None:
                p["ttft_ms"].append(f.timings.ttft_ms)
            if f.timings.e2e_ms is not None:
                p["e2e_ms"].append(f.timings.e2e_ms)
            if f.timings.queue_ms is not None:
                p["queue_ms"].append(f.timings.queue_ms)
        else:
            p["rejected"][f"{f.status}/{f.reason}"] += 1
    # What a completed request of each tenant was served (the instant engine counts prompt bytes); a tenant none
    # of whose requests completed is costed like the dearest that did.
    per_request = {t: tokens[t] / per[t]["completed"] for t in per if per[t]["completed"]}
    dearest = max(per_request.values(), default=1.0)
    demands = {t: asked[t] * per_request.get(t, dearest) for t in asked}
    served_total = sum(tokens.values())
    shares = fair_shares(demands, served_total)
    tenants = {}
    for tenant, p in sorted(per.items()):
        tenants[tenant] = {
            "sent": p["sent"], "completed": p["completed"], "rejected": dict(p["rejected"]),
            "tokens_served": tokens[tenant], "fair_share_tokens": round(shares[tenant], 1),
            "share_of_fair": round(tokens[tenant] / shares[tenant], 3) if shares[tenant] else None,
            "ttft_p50_ms": quantile(p["ttft_ms"], 0.5), "ttft_p99_ms": quantile(p["ttft_ms"], 0.99),
            "e2e_p50_ms": quantile(p["e2e_ms"], 0.5), "e2e_p90_ms": quantile(p["e2e_ms"], 0.9),
            "queue_p50_ms": quantile(p["queue_ms"], 0.5), "queue_p90_ms": quantile(p["queue_ms"], 0.9),
        }
    return {"run": name, "capacity_requests_per_s": round(capacity, 1), "offered_requests_per_s": round(rate, 1),
            "send_s": round(send_s, 1), "span_s": round(span_s, 1),
            "tokens_per_s": round(served_total / max(span_s, 1e-9), 1),
            "tenants": tenants}


async def fairness(bootstrap: str, tmp: Path, a: argparse.Namespace) -> dict:
    runs = {}
    for name in ("alone", "fair", "fcfs"):
        runs[name] = await fairness_run(bootstrap, tmp, name, a)
        print(json.dumps(runs[name], indent=1), flush=True)
    fair, alone, fcfs = runs["fair"], runs["alone"], runs["fcfs"]
    checks = {}
    for tenant in CALM:
        t, base = fair["tenants"][tenant], alone["tenants"][tenant]
        ratio = (t["ttft_p99_ms"] / base["ttft_p99_ms"]) if t["ttft_p99_ms"] and base["ttft_p99_ms"] else None
        fcfs_p99 = fcfs["tenants"][tenant]["ttft_p99_ms"]
        e2e = (t["e2e_p90_ms"] / base["e2e_p90_ms"]) if t["e2e_p90_ms"] and base["e2e_p90_ms"] else None
        checks[tenant] = {"share_of_fair": t["share_of_fair"], "ttft_p99_vs_alone": round(ratio, 2) if ratio else None,
                          "e2e_p90_vs_alone": round(e2e, 2) if e2e else None,
                          "completed": f'{t["completed"]}/{t["sent"]}',
                          "fcfs_share_of_fair": fcfs["tenants"][tenant]["share_of_fair"],
                          "fcfs_ttft_p99_vs_alone": round(fcfs_p99 / base["ttft_p99_ms"], 2)
                          if fcfs_p99 and base["ttft_p99_ms"] else None}
    rejected = {t: sum(v["rejected"].values()) for t, v in fair["tenants"].items()}
    return {"runs": runs, "checks": checks,
            "floors_met": all(c["share_of_fair"] is not None and c["share_of_fair"] >= FLOOR_SHARE
                              and c["ttft_p99_vs_alone"] is not None and c["ttft_p99_vs_alone"] <= FLOOR_TTFT_RATIO
                              for c in checks.values())
            and rejected.get("flood", 0) > sum(rejected.get(t, 0) for t in CALM),
            "rejected_in_fair": rejected,
            "fair_over_fcfs_tokens_per_s": round(fair["tokens_per_s"] / fcfs["tokens_per_s"], 3)}


# ---- fleet ---------------------------------------------------------------------------------------------------


async def fleet_run(bootstrap: str, tmp: Path, name: str, a: argparse.Namespace) -> dict:
    """Two model-free workers (`--step-ms`, 8 seats); `wide` sends to both partitions of priority 1, `narrow` as
    much to one; the tokens each tenant got in the second half of `--seconds`."""
    env = {"ENGINE_MAX_NUM_SEQS": "8", "WORKER_MAX_WAITING": "32", "WORKER_RESUME_WAITING": "16",
           "WORKER_MAX_QUEUE_TIME_S": "[10, 2, 0]",
           "WORKER_STATUS_INTERVAL_S": "0.2", "WORKER_TENANT_FLEET_SHARE": "true" if name == "fleet" else "false"}
    args = ["--engine", "fake", "--fake-step-ms", str(a.step_ms), "--fake-per-seq-ms", "1",
            "--fake-eos-probability", "0"]
    async with Run(bootstrap, tmp, name, env, args, 2) as run:
        k = run.kafka
        first = k.partitions_per_priority
        narrow_keys = [key for key in (f"narrow-session-{i}" for i in range(40))
                       if partition_for(1, key, k.num_request_partitions, k.num_priorities) == first][:4]
        sent: list[GenerationRequest] = []
        start, tick = time.monotonic(), 0
        while time.monotonic() - start < a.seconds:  # per 0.1 s: 4 of wide (random ids), 2 of narrow
            batch = [GenerationRequest(id=f"wide-{tick}-{uuid.uuid4().hex[:12]}", prompt="w",
                                       max_new_tokens=a.max_new_tokens, tenant="wide") for _ in range(4)]
            batch += [GenerationRequest(id=f"narrow-{tick}-{j}", prompt="n", max_new_tokens=a.max_new_tokens,
                                        tenant="narrow", session_id=narrow_keys[(tick + j) % len(narrow_keys)])
                      for j in range(2)]
            for r in batch:
                await run.send(r)
            sent += batch
            tick += 1
            await asyncio.sleep(max(0.0, tick * 0.1 - (time.monotonic() - start)))
        await run.producer.flush()
        await run.wait_for([r.id for r in sent], 300)
    half = tick // 2
    served: Counter = Counter()
    by_worker: Counter = Counter()
    for r in sent:
        f = run.finals[r.id]
        if int(r.id.split("-")[1]) >= half and f.status == "completed":
            served[r.tenant] += f.usage.completion_tokens
            by_worker[f"{f.worker_id}/{r.tenant}"] += f.usage.completion_tokens
    total = served["narrow"] + served["wide"]
    return {"run": name, "narrow_share": round(served["narrow"] / total, 3) if total else None,
            "tokens": dict(served), "tokens_by_worker_and_tenant": dict(sorted(by_worker.items()))}


async def fleet(bootstrap: str, tmp: Path, a: argparse.Namespace) -> dict:
    runs = []
    for _ in range(a.reps):
        for name in ("fleet", "per-worker"):
            runs.append(await fleet_run(bootstrap, tmp, name, a))
            print(json.dumps(runs[-1]), flush=True)
    shares = {name: [r["narrow_share"] for r in runs if r["run"] == name] for name in ("fleet", "per-worker")}
    return {"runs": runs, "narrow_share": shares}


# ---- a fleet of three, six tenants ---------------------------------------------------------------------------

FLEET6_TOKENS = {"small-all": 5, "large-all": 100, "small-two": 5, "large-two": 100, "small-one": 5,
                 "large-one": 100}
FLEET6_SPREAD = {"small-all": 6, "large-all": 6, "small-two": 2, "large-two": 2, "small-one": 1, "large-one": 1}
"""How many of priority 1's six partitions each tenant's requests reach: tenants skewed over the workers."""
FLEET6_WINDOW_S = 60.0
FLEET6_FLOOR_GAP = 2 * max(FLEET6_TOKENS.values())
FLEET6_FLOOR_THROUGHPUT = 0.95


def fleet6_partitions(partitions: list[int], assigned: dict[str, tuple[int, ...]], placement: str
                      ) -> dict[int, set[int]]:
    """The partitions of tenants on all six, two and one of them. The assignor decides which worker holds which
    partition, so the skewed tenants' two partitions are chosen after it: `split`, on two workers (the fleet can
    then give every tenant the same service); `together`, on one worker, which alone then serves four of the six
    tenants while the other two see only the spread tenants' part of the traffic. No work-conserving fleet
    splits evenly then: the four get at most a quarter of one worker each, and the spread tenants get all the
    other two serve. `fixed`: the priority's first two, wherever they are."""
    owner = {p: w for w, ps in assigned.items() for p in ps}
    one = partitions[0]
    if placement == "fixed":
        two = partitions[1]
    else:
        two = next(p for p in partitions[1:] if (owner[p] == owner[one]) == (placement == "together"))
    return {6: set(partitions), 2: {one, two}, 1: {one}}


async def fleet6_run(bootstrap: str, tmp: Path, name: str, a: argparse.Namespace) -> dict:
    """Three model-free workers (`--step-ms` + 1 ms a seat, 8 seats), six partitions a priority; six tenants at
    priority 1, each offering twice its share of the fleet. `fleet`: tenants named, fleet share on;
    `per-worker`: named, fleet share off; `fcfs`: no tenant named. Service by tenant in each minute (tokens of
    requests completed in it), after a warm-up of 10 s."""
    env = {"ENGINE_MAX_NUM_SEQS": "8", "WORKER_STATUS_INTERVAL_S": "0.2",
           "WORKER_TENANT_FLEET_SHARE": "true" if name == "fleet" else "false"}
    args = ["--engine", "fake", "--fake-step-ms", str(a.step_ms), "--fake-per-seq-ms", "1",
            "--fake-eos-probability", "0"]
    capacity = 3 * 8 * 1000.0 / (a.step_ms + 8)  # output tokens/s of the fleet, saturated
    async with Run(bootstrap, tmp, name, env, args, 3, partitions_per_priority=6) as run:
        k = run.kafka
        first = k.partitions_per_priority  # priority 1's partitions: first .. first + 5
        wanted_by_spread = fleet6_partitions(list(range(first, first + 6)), run.assigned, a.placement)
        keys: dict[str, list[str]] = {}
        for tenant, spread in FLEET6_SPREAD.items():
            wanted = wanted_by_spread[spread]
            found: dict[int, str] = {}
            for i in range(10_000):
                key = f"{tenant}-key-{i}"
                partition = partition_for(1, key, k.num_request_partitions, k.num_priorities)
                if partition in wanted and partition not in found:
                    found[partition] = key
                if len(found) == spread:
                    break
            keys[tenant] = list(found.values())
        due = dict.fromkeys(FLEET6_TOKENS, 0.0)
        interval = {t: tokens / (2.0 * capacity / len(FLEET6_TOKENS)) for t, tokens in FLEET6_TOKENS.items()}
        sent: list[tuple[str, GenerationRequest]] = []
        sent_at: dict[str, float] = {}
        count = Counter()
        start, wall0 = time.monotonic(), time.time()
        while (now := time.monotonic() - start) < a.seconds:
            for tenant in FLEET6_TOKENS:
                while due[tenant] <= now:
                    n = count[tenant]  # the tenant's own count: its requests take its partitions in turn
                    count[tenant] += 1
                    request = GenerationRequest(
                        id=f"{tenant}-{n}-{uuid.uuid4().hex[:8]}", prompt="x", max_new_tokens=FLEET6_TOKENS[tenant],
                        tenant=tenant if name != "fcfs" else None,
                        session_id=keys[tenant][n % len(keys[tenant])])
                    sent_at[request.id] = time.time()
                    await run.send(request)
                    sent.append((tenant, request))
                    due[tenant] += interval[tenant]
            await asyncio.sleep(max(0.0, min(due.values()) - (time.monotonic() - start)))
        await run.producer.flush()
        await run.wait_for([r.id for _, r in sent], 600)
    windows: list[Counter] = []
    served_total = 0
    outcomes: dict[str, Counter] = {t: Counter() for t in FLEET6_TOKENS}
    for tenant, r in sent:
        f = run.finals[r.id]
        cause = " (full queue)" if "full queue" in f.message else ""  # else shed by lag
        outcomes[tenant][f.status if f.status == "completed" else f"{f.status}/{f.reason}{cause}"] += 1
        if f.status != "completed":
            continue
        done = sent_at[r.id] + (f.timings.e2e_ms or 0.0) / 1000.0 - wall0
        served_total += f.usage.completion_tokens
        w = int((done - 10.0) // FLEET6_WINDOW_S)
        if 0 <= w and (w + 1) * FLEET6_WINDOW_S + 10.0 <= a.seconds:
            while len(windows) <= w:
                windows.append(Counter())
            windows[w][tenant] += f.usage.completion_tokens
    gaps = [max(c[t] for t in FLEET6_TOKENS) - min(c[t] for t in FLEET6_TOKENS) for c in windows]
    in_windows = sum(sum(c.values()) for c in windows)
    # Service as the fair share counts it (prompt and output tokens, as VTC's counter), at the time it was
    # delivered: output tokens at their chunk's record time, the prompt's at the request's first chunk. A request
    # running across a minute's edge then counts on both sides, not whole in the minute it ended.
    tenant_of = {r.id: tenant for tenant, r in sent}
    served: list[Counter] = [Counter() for _ in windows]
    first_chunk: dict[str, float] = {}

    def add(at: float, tenant: str, tokens: int) -> None:
        w = int((at - wall0 - 10.0) // FLEET6_WINDOW_S)
        if 0 <= w < len(served):
            served[w][tenant] += tokens
    for rid, at, tokens in run.chunks:
        if rid in tenant_of:
            add(at, tenant_of[rid], tokens)
            first_chunk[rid] = min(at, first_chunk.get(rid, at))
    for rid, at in first_chunk.items():
        add(at, tenant_of[rid], run.finals[rid].usage.prompt_tokens)
    service_gaps = [max(c[t] for t in FLEET6_TOKENS) - min(c[t] for t in FLEET6_TOKENS) for c in served]
    return {"run": name, "tokens_by_minute": [dict(c) for c in windows], "gaps": gaps,
            "service_by_minute": [dict(c) for c in served], "service_gaps": service_gaps,
            "service_tokens_per_s": round(sum(sum(c.values()) for c in served)
                                          / max(len(served) * FLEET6_WINDOW_S, 1e-9), 1),
            "tokens_per_s_in_windows": round(in_windows / max(len(windows) * FLEET6_WINDOW_S, 1e-9), 1),
            "served_tokens": served_total, "capacity_tokens_per_s": round(capacity, 1),
            "outcomes": {t: dict(c) for t, c in outcomes.items()},
            "assigned": {w: list(p) for w, p in sorted(run.assigned.items())},
            "partitions": {t: sorted({partition_for(1, key, k.num_request_partitions, k.num_priorities)
                                      for key in keys[t]}) for t in FLEET6_TOKENS}}


async def fleet6(bootstrap: str, tmp: Path, a: argparse.Namespace) -> dict:
    runs = {}
    for name in a.modes.split(","):
        runs[name] = await fleet6_run(bootstrap, tmp, name, a)
        print(json.dumps(runs[name]), flush=True)
    if not {"fleet", "per-worker", "fcfs"} <= set(runs):
        return {"runs": runs, "floors_met": None}
    fcfs_rate = runs["fcfs"]["tokens_per_s_in_windows"]
    checks = {name: {"largest_gap": max(runs[name]["gaps"], default=None),
                     "largest_service_gap": max(runs[name]["service_gaps"], default=None),
                     "throughput_vs_fcfs": round(runs[name]["tokens_per_s_in_windows"] / fcfs_rate, 3)
                     if fcfs_rate else None} for name in ("fleet", "per-worker")}

    def met(gap: str) -> bool:
        c = checks["fleet"]
        return (c[gap] is not None and c[gap] <= FLEET6_FLOOR_GAP
                and (c["throughput_vs_fcfs"] or 0) >= FLEET6_FLOOR_THROUGHPUT)
    return {"runs": runs, "checks": checks, "placement": a.placement, "floor_gap_tokens": FLEET6_FLOOR_GAP,
            "floors_met": {"service": met("largest_service_gap"), "completed_output": met("largest_gap")}}


# ---- flood (real model) --------------------------------------------------------------------------------------

FLOOR_E2E_RATIO = 2.0
FLOOR_FLOOD_SHARE = 0.9
FLOOD_RATES = {"a": 2.0, "b": 2.0, "flood": 40.0}
FLOOD_TOKENS = {"a": 16, "b": 16, "flood": 96}


async def flood_run(bootstrap: str, tmp: Path, name: str, a: argparse.Namespace,
                    rates: dict[str, float] = FLOOD_RATES) -> dict:
    tenants = ("a", "b", "flood") if name.startswith("fair") else {"solo": ("a", "b"), "flood-alone": ("flood",)}[name]
    # Default settings, and the torch threads a worker on this machine has by default (one per core).
    env = {"OMP_NUM_THREADS": str(a.threads or os.cpu_count() or 1), **({"ENGINE_MODEL": a.model} if a.model else {})}
    if name.startswith("fair-step-"):
        env["ENGINE_FAIR_STEP_MS"] = name.removeprefix("fair-step-")
    async with Run(bootstrap, tmp, name, env, ["--engine", "llm"], 1) as run:
        sent: list[GenerationRequest] = []
        sent_at: dict[str, float] = {}
        start, wall0 = time.monotonic(), time.time()
        due = dict.fromkeys(tenants, 0.0)
        while (now := time.monotonic() - start) < a.seconds:
            for tenant in tenants:
                while due[tenant] <= now:
                    request = GenerationRequest(
                        id=f"{name}-{tenant}-{uuid.uuid4().hex[:12]}", prompt=f"Tell {tenant} a story, please.",
                        max_new_tokens=FLOOD_TOKENS[tenant], sampling=SamplingSpec(ignore_eos=True), tenant=tenant)
                    sent_at[request.id] = time.time()
                    await run.send(request)
                    sent.append(request)
                    due[tenant] += 1.0 / rates[tenant]
            await asyncio.sleep(max(0.0, min(due.values()) - (time.monotonic() - start)))
        await run.producer.flush()
        await run.wait_for([r.id for r in sent], 600)
    done_at = {r.id: sent_at[r.id] + (run.finals[r.id].timings.e2e_ms or 0.0) / 1000.0 for r in sent
               if run.finals[r.id].status == "completed"}
    span_s = max(done_at.values(), default=wall0) - wall0
    per: dict[str, dict] = {}
    for r in sent:
        f = run.finals[r.id]
        p = per.setdefault(r.tenant, {"sent": 0, "completed": 0, "rejected": Counter(), "e2e_ms": [], "tokens": 0,
                                      "queue_ms": [], "ttft_ms": []})
        p["sent"] += 1
        if f.status != "completed":
            p["rejected"][f"{f.status}/{f.reason}"] += 1
            continue
        p["completed"] += 1
        p["e2e_ms"].append(f.timings.e2e_ms or 0.0)
        p["queue_ms"].append(f.timings.queue_ms or 0.0)
        p["ttft_ms"].append(f.timings.ttft_ms or 0.0)
        p["tokens"] += f.usage.completion_tokens
    return {"run": name, "span_s": round(span_s, 1), "tenants": {t: {
        "sent": p["sent"], "completed": p["completed"], "rejected": dict(p["rejected"]),
        "e2e_p50_ms": quantile(p["e2e_ms"], 0.5), "e2e_p90_ms": quantile(p["e2e_ms"], 0.9),
        "queue_p90_ms": quantile(p["queue_ms"], 0.9), "ttft_p90_ms": quantile(p["ttft_ms"], 0.9),
        "tokens": p["tokens"], "tokens_per_s": round(p["tokens"] / max(span_s, 1e-9), 1)}
        for t, p in sorted(per.items())}}


def scaled_rates(capacity_tokens_per_s: float) -> dict[str, float]:
    """The issue's traffic in proportion to this worker: there the flood offered ten times what the worker
    served (40 requests/s of 96 tokens) and a and b together a sixth of it (2 requests/s each of 16 tokens)."""
    served = FLOOD_RATES["flood"] * FLOOD_TOKENS["flood"] / 10.0  # what the worker served, tokens/s
    calm = FLOOD_RATES["a"] * capacity_tokens_per_s / served
    return {"a": calm, "b": calm, "flood": 10.0 * capacity_tokens_per_s / FLOOD_TOKENS["flood"]}


async def flood(bootstrap: str, tmp: Path, a: argparse.Namespace) -> dict:
    runs = {}
    rates = FLOOD_RATES
    names = ("flood-alone", "solo", "fair") if a.scaled else ("solo", "flood-alone", "fair")
    names += tuple(f"fair-step-{ms:g}" for ms in a.fair_step_ms)
    for name in names:
        runs[name] = await flood_run(bootstrap, tmp, name, a, rates)
        runs[name]["rates_per_s"] = {t: round(r, 3) for t, r in rates.items()}
        print(json.dumps(runs[name]), flush=True)
        if a.scaled and name == "flood-alone":
            rates = scaled_rates(runs[name]["tenants"]["flood"]["tokens_per_s"])
    solo, alone = runs["solo"]["tenants"], runs["flood-alone"]["tenants"]
    checks = {name: flood_checks(solo, alone, runs[name]["tenants"]) for name in names if name.startswith("fair")}
    return {"runs": runs, "checks": checks, "floors_met": {name: c.pop("met") for name, c in checks.items()}}


def flood_checks(solo: dict, alone: dict, fair: dict) -> dict:
    """The issue's floors for one run with all three tenants: a and b complete all and keep p90 <= 2x solo, and
    the flood gets >= 90 % of the room they leave of what the worker serves with the flood alone."""
    checks: dict = {}
    for tenant in ("a", "b"):
        t = fair[tenant]
        checks[tenant] = {"completed": f'{t["completed"]}/{t["sent"]}',
                          "e2e_p90_vs_solo": round(t["e2e_p90_ms"] / solo[tenant]["e2e_p90_ms"], 2)
                          if t["e2e_p90_ms"] and solo[tenant]["e2e_p90_ms"] else None}
    room = alone["flood"]["tokens_per_s"] - fair["a"]["tokens_per_s"] - fair["b"]["tokens_per_s"]
    checks["flood"] = {"tokens_per_s": fair["flood"]["tokens_per_s"], "room_tokens_per_s": round(room, 1),
                       "share_of_room": round(fair["flood"]["tokens_per_s"] / room, 3) if room > 0 else None}
    checks["met"] = all(checks[t]["completed"].split("/")[0] == checks[t]["completed"].split("/")[1]
                        and checks[t]["e2e_p90_vs_solo"] is not None and checks[t]["e2e_p90_vs_solo"] <= FLOOR_E2E_RATIO
                        for t in ("a", "b")) and (checks["flood"]["share_of_room"] or 0) >= FLOOR_FLOOD_SHARE
    return checks


# ---- sessions ------------------------------------------------------------------------------------------------


TOPICS = ["rivers", "volcanoes", "bridges", "glaciers", "lighthouses", "deserts", "orchards", "harbors"]


def opening(conversation: int) -> str:
    """A context of its own for each conversation (about 150 tokens), so only its own history can be cached."""
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(f"Note {k} about {topic} number {conversation}: it is the {k}th thing to remember, and "
                     f"it matters for the question." for k in range(8))
    return f"Here are my notes about {topic}. {facts} Please keep them in mind."


async def sessions_run(bootstrap: str, tmp: Path, name: str, a: argparse.Namespace) -> dict:
    env = {"ENGINE_MODEL": a.model, "WORKER_MAX_QUEUE_TIME_S": "[0, 0, 0]"} if a.model else {
        "WORKER_MAX_QUEUE_TIME_S": "[0, 0, 0]"}
    histories = {c: [ChatMessage(role="user", content=opening(c))] for c in range(a.conversations)}
    finals: list[FinalRecord] = []
    same_worker = []
    async with Run(bootstrap, tmp, name, env, ["--engine", "llm"], 2) as run:
        last_worker: dict[int, str] = {}
        for turn in range(a.turns):
            requests = []
            for c in range(a.conversations):
                if turn:
                    histories[c].append(ChatMessage(role="user", content=f"Question {turn}: what is note {turn}?"))
                # Random ids, as real traffic has: CRC-32 is linear, so ids that differ in one digit would pick
                # partitions in a pattern rather than at random.
                requests.append(GenerationRequest(
                    id=f"{name}-c{c}-t{turn}-{uuid.uuid4().hex[:12]}", messages=list(histories[c]),
                    max_new_tokens=a.max_new_tokens,
                    session_id=f"conv-{c}" if name == "session" else None))
            for r in requests:
                await run.send(r)
            await run.producer.flush()
            await run.wait_for([r.id for r in requests], 1800)
            for c, r in enumerate(requests):
                f = run.finals[r.id]
                finals.append(f)
                if c in last_worker:
                    same_worker.append(last_worker[c] == f.worker_id)
                last_worker[c] = f.worker_id
                histories[c].append(ChatMessage(role="assistant", content=f.text or ""))
            print(f"{name} turn {turn}: {sum(f.usage.cached_tokens for f in finals)} of "
                  f"{sum(f.usage.prompt_tokens for f in finals)} prompt tokens cached so far", flush=True)
    prompt = sum(f.usage.prompt_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in finals)
    later = [f for f in finals if "-t0-" not in f.id]
    ttft = [f.timings.ttft_ms for f in finals if f.timings.ttft_ms is not None]
    ttft_later = [f.timings.ttft_ms for f in later if f.timings.ttft_ms is not None]
    return {"run": name, "requests": len(finals), "completed": sum(f.status == "completed" for f in finals),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 3) if prompt else None,
            "hit_rate_after_first_turn": round(sum(f.usage.cached_tokens for f in later)
                                               / max(1, sum(f.usage.prompt_tokens for f in later)), 3),
            "same_worker_as_previous_turn": round(sum(same_worker) / max(1, len(same_worker)), 3),
            "ttft_p50_ms": quantile(ttft, 0.5), "ttft_p90_ms": quantile(ttft, 0.9),
            "ttft_later_turns_p50_ms": quantile(ttft_later, 0.5), "ttft_later_turns_p90_ms": quantile(ttft_later, 0.9)}


async def sessions(bootstrap: str, tmp: Path, a: argparse.Namespace) -> dict:
    runs = {}
    for name in ("session", "request"):
        runs[name] = await sessions_run(bootstrap, tmp, name, a)
        print(json.dumps(runs[name], indent=1), flush=True)
    return {"runs": runs, "floors_met": (runs["session"]["hit_rate"] or 0) >= FLOOR_HIT_RATE}


# ---- output --------------------------------------------------------------------------------------------------


def plot(part: str, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if part == "fairness":
        runs = summary["runs"]
        names = ["alone", "fair", "fcfs"]
        for j, tenant in enumerate(("flood", *CALM)):
            axes[0].bar([i + 0.27 * j for i in range(3)],
                        [runs[n]["tenants"].get(tenant, {}).get("share_of_fair") or 0 for n in names], 0.27,
                        label=tenant)
            axes[1].bar([i + 0.27 * j for i in range(3)],
                        [(runs[n]["tenants"].get(tenant, {}).get("ttft_p99_ms") or 0) / 1000 for n in names], 0.27,
                        label=tenant)
        axes[0].axhline(FLOOR_SHARE, color="grey", ls="--", lw=1)
        axes[0].set(xticks=[0.27, 1.27, 2.27], xticklabels=names, ylabel="tokens served / max-min fair share",
                    title="share of fair share")
        axes[1].set(xticks=[0.27, 1.27, 2.27], xticklabels=names, ylabel="TTFT p99 (s)", yscale="log",
                    title="time to first token, p99")
        axes[0].legend()
    else:
        runs = summary["runs"]
        names = list(runs)
        axes[0].bar(names, [runs[n]["hit_rate"] for n in names])
        axes[0].axhline(FLOOR_HIT_RATE, color="grey", ls="--", lw=1)
        axes[0].set(ylabel="cached / prompt tokens", title="prefix-cache hit rate", ylim=(0, 1))
        for j, q in enumerate(("ttft_p50_ms", "ttft_p90_ms")):
            axes[1].bar([i + 0.4 * j for i in range(len(names))], [(runs[n][q] or 0) / 1000 for n in names], 0.4,
                        label=q.split("_")[1])
        axes[1].set(xticks=[0.2 + i for i in range(len(names))], xticklabels=names, ylabel="seconds",
                    title="time to first token")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["fairness", "sessions", "fleet", "fleet6", "flood"])
    p.add_argument("--bootstrap", default=None, help="a running broker (default: a local one on free ports)")
    p.add_argument("--label", default="")
    p.add_argument("--seconds", type=float, default=60.0, help="fairness: seconds of traffic per run")
    p.add_argument("--overload", type=float, default=3.0, help="fairness: offered load over capacity")
    p.add_argument("--step-ms", type=float, default=40.0, help="fairness: the instant engine's step time")
    p.add_argument("--max-num-seqs", type=int, default=16, help="fairness: engine seats")
    p.add_argument("--max-waiting", type=int, default=64, help="fairness: WORKER_MAX_WAITING")
    p.add_argument("--max-new-tokens", type=int, default=None, help="fairness 20, sessions 24")
    p.add_argument("--flood-tokens", type=int, default=0, help="fairness: the flood's max_new_tokens (0: the same)")
    p.add_argument("--engine", choices=["instant", "fake"], default="instant",
                   help="fairness: instant (every step alike) or fake (step time grows with the batch, prompts "
                        "cost, preemption recomputes)")
    p.add_argument("--per-seq-ms", type=float, default=1.0, help="fairness, fake engine: step time per seat")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--model", default="", help="sessions, flood: ENGINE_MODEL (default: the default model)")
    p.add_argument("--reps", type=int, default=2, help="fleet: runs of each mode, alternating")
    p.add_argument("--modes", default="fleet,per-worker,fcfs", help="fleet6: the runs, in order")
    p.add_argument("--placement", choices=["split", "together", "fixed"], default="split",
                   help="fleet6: the skewed tenants' two partitions on two workers, on one, or the first two")
    p.add_argument("--threads", type=int, default=0, help="flood: the worker's torch threads (0: one per core)")
    p.add_argument("--fair-step-ms", type=lambda v: [float(x) for x in v.split(",")], default=[],
                   help="flood: one more run, fair-step-<ms>, with ENGINE_FAIR_STEP_MS at each of these (commas)")
    p.add_argument("--scaled", action="store_true",
                   help="flood: the rates in proportion to what this worker serves with the flood alone")
    return p.parse_args(argv)


async def amain(a: argparse.Namespace) -> dict:
    from benchmarks.bench_kafka_path import kafka_session

    if a.max_new_tokens is None:
        a.max_new_tokens = {"fairness": 20, "fleet": 10}.get(a.part, 24)
    with kafka_session(a.bootstrap, prefix="bench-tenants-") as session:
        part = {"fairness": fairness, "sessions": sessions, "fleet": fleet, "fleet6": fleet6, "flood": flood}[a.part]
        summary = await part(session.bootstrap, session.tmp, a)
        date = datetime.date.today().isoformat()
        out = REPO / "benchmarks" / "results" / (f"{date}-tenants" + (f"-{a.label}" if a.label else ""))
        out.mkdir(parents=True, exist_ok=True)
        summary["command"] = "python -m benchmarks.bench_tenants " + " ".join(a.argv)
        summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
        (out / f"summary-{a.part}.json").write_text(json.dumps(summary, indent=2) + "\n")
        if a.part in ("fairness", "sessions"):
            plot(a.part, summary, out / f"{a.part}.png")
        summary["written_to"] = str(out)
        return summary


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    summary = asyncio.run(amain(a))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    met = summary.get("floors_met", True)
    return 0 if (all(met.values()) if isinstance(met, dict) else met is not False) else 1


if __name__ == "__main__":
    sys.exit(main())
