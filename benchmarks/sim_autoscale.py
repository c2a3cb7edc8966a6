"""The autoscaling signal in simulated time: a load step up and down, a fleet that an HPA-like autoscaler (as
KEDA drives it) sizes from the workers' `desired_workers`, and how fast and how closely the estimate follows.

No broker, no engine: offered load arrives as Poisson requests over three priorities, the ready workers serve
the backlog most urgent first at a fixed capacity each, and every worker runs the real estimator
(worker/transport/load/autoscale.py: ArrivalRate and workers_needed) on its share of the partitions at every
control tick. The autoscaler polls every 15 s, asks for ceil(average estimate) within a 10 % tolerance,
scales up at once and down only to the largest recommendation of its stabilization window (the HPA's rules);
a new worker is ready only after it loaded its model and joined the group.

    .venv/bin/python -m benchmarks.sim_autoscale            # ~10 s; results/<date>-autoscale/
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from worker.worker_settings import WorkerSettings
from worker.transport.load.autoscale import TARGET_UTILIZATION, ScaleSignal

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Scenario:
    capacity_tokens_per_s: float = 1000.0
    """One worker's capacity when saturated (tokens are in these units: the shape is what matters)."""
    request_tokens: float = 300.0
    priority_mix: tuple[float, ...] = (0.2, 0.3, 0.5)
    budgets_s: tuple[float, ...] = tuple(WorkerSettings.model_fields["max_queue_time_s"].default)
    """WORKER_MAX_QUEUE_TIME_S as shipped (0: no bound, the bulk priority waits rather than being shed)."""
    partitions_per_priority: int = 8
    phases: tuple[tuple[float, float], ...] = ((0.0, 1600.0), (120.0, 4800.0), (480.0, 1600.0))
    """(start s, offered tokens/s): 2 workers' worth, a step to 6, back to 2."""
    duration_s: float = 900.0
    tick_s: float = 0.1
    poll_s: float = 15.0
    """KEDA's pollingInterval and the HPA's sync period."""
    tolerance: float = 0.1
    """The HPA leaves the replica count alone while metric / target is within this of 1."""
    scale_down_window_s: float = 300.0
    """The HPA's scale-down stabilization window (deploy/keda-scaledobject.yaml keeps the default)."""
    ready_after_s: float = 60.0
    """Model load and group join of a new worker."""
    min_replicas: int = 1
    initial_replicas: int = 2
    seed: int = 7

    @property
    def max_replicas(self) -> int:
        return self.partitions_per_priority

    def offered(self, t: float) -> float:
        rate = self.phases[0][1]
        for start, value in self.phases:
            if t >= start:
                rate = value
        return rate

    def need(self, t: float) -> float:
        """Workers the offered load alone needs at the target utilization."""
        return self.offered(t) / TARGET_UTILIZATION / self.capacity_tokens_per_s


@dataclass(slots=True)
class Fleet:
    ready: int
    starting: list[float] = field(default_factory=list)
    """When each starting worker becomes ready."""
    recommendations: list[tuple[float, int]] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        return self.ready + len(self.starting)


def simulate(sc: Scenario) -> dict:
    rng = random.Random(sc.seed)
    num_priorities = len(sc.priority_mix)
    num_partitions = num_priorities * sc.partitions_per_priority
    backlog = [0.0] * num_priorities
    served_total = 0.0
    # As if the autoscaler had run at the initial size for a while (its history holds that recommendation).
    fleet = Fleet(ready=sc.initial_replicas, recommendations=[(0.0, sc.initial_replicas)])
    signal = ScaleSignal(list(sc.budgets_s), num_partitions)
    series = {k: [] for k in ("t", "offered", "arrived", "backlog", "est_wait", "estimate", "ready", "replicas",
                              "need")}
    next_poll, window_arrived, window_start = 0.0, 0.0, 0.0
    estimate = None
    num_ticks = int(sc.duration_s / sc.tick_s)
    for i in range(num_ticks):
        t = i * sc.tick_s
        # Arrivals: Poisson requests, each to a priority by the mix.
        mean = sc.offered(t) * sc.tick_s / sc.request_tokens
        arrived = 0.0
        for _ in range(_poisson(rng, mean)):
            p = rng.choices(range(num_priorities), sc.priority_mix)[0]
            backlog[p] += sc.request_tokens
            arrived += sc.request_tokens
        # Service: the ready workers, most urgent first.
        budget = fleet.ready * sc.capacity_tokens_per_s * sc.tick_s
        for p in range(num_priorities):
            taken = min(backlog[p], budget)
            backlog[p] -= taken
            budget -= taken
            served_total += taken
        # Workers that finished loading join (the group rebalances: every share changes).
        fleet.starting, joined = [s for s in fleet.starting if s > t], [s for s in fleet.starting if s <= t]
        fleet.ready += len(joined)
        # The estimator, as one worker of the even split runs it on its share of the partitions.
        share_parts = max(1, num_partitions // max(fleet.ready, 1))
        share = share_parts / num_partitions
        # Partition numbers stand for (group size, partition): the assignment changes whenever the group does.
        assignment = frozenset(range(100 * fleet.ready, 100 * fleet.ready + share_parts))
        own_backlog = [b * share for b in backlog]
        estimate = signal.update(t, sum(own_backlog), served_total * share, own_backlog,
                                 sc.capacity_tokens_per_s, assignment)
        # The autoscaler.
        if t >= next_poll and estimate is not None:
            next_poll += sc.poll_s
            _autoscale(sc, fleet, estimate, t)
        window_arrived += arrived
        if t - window_start >= 1.0 - 1e-9 or i == num_ticks - 1:
            capacity = fleet.ready * sc.capacity_tokens_per_s
            ahead, waits = 0.0, []
            for p in range(num_priorities):
                ahead += backlog[p]
                waits.append(ahead / capacity if capacity else math.inf)
            for key, value in (("t", t), ("offered", sc.offered(t)), ("arrived", window_arrived / (t - window_start
                               + sc.tick_s)), ("backlog", sum(backlog)), ("est_wait", waits),
                               ("estimate", estimate), ("ready", fleet.ready), ("replicas", fleet.replicas),
                               ("need", sc.need(t))):
                series[key].append(value)
            window_arrived, window_start = 0.0, t + sc.tick_s
    return {"scenario": _scenario_dict(sc), "series": series, "summary": _summarize(sc, series)}


def _autoscale(sc: Scenario, fleet: Fleet, metric: float, t: float) -> None:
    """The HPA's rule for an external metric of type AverageValue with target 1: desired = ceil(metric)."""
    current = max(fleet.replicas, 1)
    desired = current if abs(metric / current - 1.0) <= sc.tolerance else math.ceil(metric)
    desired = max(sc.min_replicas, min(sc.max_replicas, desired))
    fleet.recommendations.append((t, desired))
    fleet.recommendations = [(s, d) for s, d in fleet.recommendations if t - s <= sc.scale_down_window_s]
    if desired < current:
        desired = max(d for _, d in fleet.recommendations)
    if desired > fleet.replicas:
        fleet.starting += [t + sc.ready_after_s] * (desired - fleet.replicas)
    elif desired < fleet.replicas:
        drop = fleet.replicas - desired
        while drop and fleet.starting:
            fleet.starting.pop()
            drop -= 1
        fleet.ready -= drop


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: the means here are a few requests a tick.
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def _first(series: dict, start: float, predicate) -> float | None:
    for i, t in enumerate(series["t"]):
        if t >= start and predicate(i):
            return t - start
    return None


def _summarize(sc: Scenario, s: dict) -> dict:
    (_, low), (up_at, high), (down_at, _) = sc.phases
    need_high, need_low = high / TARGET_UTILIZATION / sc.capacity_tokens_per_s, low / TARGET_UTILIZATION / \
        sc.capacity_tokens_per_s
    est = [e or 0.0 for e in s["estimate"]]
    out = {
        "need_low": need_low, "need_high": need_high,
        "step_up_estimate_90pct_s": _first(s, up_at, lambda i: est[i] >= 0.9 * need_high),
        "step_up_ready_s": _first(s, up_at, lambda i: s["ready"][i] >= math.ceil(need_high)),
        "step_up_peak_estimate": max(est[i] for i, t in enumerate(s["t"]) if up_at <= t < down_at),
        "step_up_peak_backlog_tokens": max(b for t, b in zip(s["t"], s["backlog"]) if up_at <= t < down_at),
        "step_up_backlog_drained_s": _first(s, up_at + 5, lambda i: s["backlog"][i] < 2 * sc.request_tokens
                                            and s["ready"][i] >= math.ceil(need_high)),
        "step_down_estimate_110pct_s": _first(s, down_at, lambda i: est[i] <= 1.1 * need_low),
        "step_down_replicas_settled_s": _first(s, down_at, lambda i: s["replicas"][i] <= s["replicas"][-1]),
        "final_replicas": s["replicas"][-1],
        "max_est_wait_over_budget": [max(w[p] / sc.budgets_s[p] for w in s["est_wait"]) if sc.budgets_s[p] > 0
                                     else None for p in range(len(sc.budgets_s))],
        "max_est_wait_s": [max(w[p] for w in s["est_wait"]) for p in range(len(sc.budgets_s))],
    }
    for name, (start, end, need) in {"low": (60.0, up_at, need_low),
                                     "high": (up_at + 180.0, down_at, need_high),
                                     "after": (down_at + 120.0, sc.duration_s, need_low)}.items():
        errors = [abs(est[i] - need) / need for i, t in enumerate(s["t"]) if start <= t < end]
        out[f"steady_{name}_median_error"] = statistics.median(errors)
        out[f"steady_{name}_p95_error"] = sorted(errors)[int(0.95 * (len(errors) - 1))]
    return out


def _scenario_dict(sc: Scenario) -> dict:
    return {k: getattr(sc, k) for k in sc.__slots__}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["series"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(s["t"], s["arrived"], lw=0.6, color="0.6", label="arrived (1 s bins)")
    axes[0].plot(s["t"], s["offered"], lw=1.5, label="offered load")
    axes[0].plot(s["t"], [r * result["scenario"]["capacity_tokens_per_s"] for r in s["ready"]], lw=1.2,
                 label="capacity of ready workers")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].plot(s["t"], s["backlog"], lw=1.2, color="C3")
    axes[1].set_ylabel("backlog (tokens)")
    axes[2].plot(s["t"], [e or 0 for e in s["estimate"]], lw=1.0, label="desired_workers (estimate)")
    axes[2].plot(s["t"], s["need"], lw=1.2, ls="--", color="k", label="offered load / (0.8 x capacity)")
    axes[2].step(s["t"], s["replicas"], where="post", lw=1.2, label="replicas asked")
    axes[2].step(s["t"], s["ready"], where="post", lw=1.2, label="replicas ready")
    axes[2].set_ylabel("workers")
    axes[2].set_xlabel("simulated time (s)")
    axes[2].legend(loc="upper right", fontsize=8)
    fig.suptitle("Autoscaling signal: a load step up and down (benchmarks/sim_autoscale.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{time.strftime('%Y-%m-%d')}-autoscale")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    result = simulate(Scenario(seed=args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "autoscale.png")
    (args.out / "summary.json").write_text(json.dumps({"scenario": result["scenario"],
                                                       "summary": result["summary"]}, indent=1))
    for key, value in result["summary"].items():
        print(f"{key:32s} {value}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
