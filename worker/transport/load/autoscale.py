"""The autoscaling signal: how many workers the group needs to serve its backlog within its time budgets.

Each worker sees only its own partitions, so it estimates the need of its share and scales it up by the share
of the request partitions it owns: with the balanced assignment the assignor gives (scaling.md) every worker's
estimate is the same figure, and an autoscaler averages them (docs/fleet.md).

For the partitions a worker owns, in tokens (prompt + expected output, priced as service_model.py prices
work):

- arrivals: tokens per second that reach its partitions (the offered load), measured over a sliding window as
  the tokens read plus the change in the tokens still unread;
- backlog: per priority, the tokens unread, waiting locally and waiting in the engine. Requests are served
  most urgent first, so priority p's requests wait behind every priority <= p, and draining them within p's
  budget (WORKER_MAX_QUEUE_TIME_S, the wait past which p is shed) takes sum(backlog_q, q <= p) / budget_p
  tokens per second; a budget of 0 means no bound (p is never shed for lag), and p then asks for none;
- the rate needed = arrivals / TARGET_UTILIZATION + the largest of those drain rates, and the workers needed
  for it = rate / capacity (tokens per second one worker serves when saturated, service_model.py).

A backlog that drains within its budgets needs nothing beyond the arrivals; one that would be shed asks for
the workers that would serve it in time instead. Pure apart from `ArrivalRate`'s window of samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

TARGET_UTILIZATION = 0.8
"""Workers are asked for so that the offered load fills this share of their measured capacity: a worker run
at its full capacity has queues that grow with every burst (its waits climb steeply past ~80 % busy), and the
capacity is itself an estimate."""

ARRIVAL_WINDOW_S = 20.0
"""The offered load is measured over this window by default (WORKER_SCALE_ARRIVAL_WINDOW_S): long enough that
the Poisson noise of a few requests a second does not ask for a worker a steady load below capacity does not
need (a 10 s window did, at 60 % of capacity, now and then), short enough that a load step shows within seconds
(benchmarks/sim_autoscale.py)."""


def workers_needed(backlog_tokens: list[float], budgets_s: list[float], arrival_tokens_per_s: float,
                   capacity_tokens_per_s: float | None, share: float) -> float | None:
    """Workers the group needs, from one worker's view of its partitions.

    backlog_tokens: per priority (0 most urgent), tokens waiting on this worker's partitions (unread, local,
    in the engine); budgets_s: per priority, the longest wait allowed (the last covers the rest);
    arrival_tokens_per_s: offered load on its partitions; capacity_tokens_per_s: what one worker serves when
    saturated (None before anything is known); share: the fraction of the request partitions it owns. None
    when no estimate can be made (no capacity known, or no partitions owned)."""
    if not capacity_tokens_per_s or capacity_tokens_per_s <= 0 or share <= 0:
        return None
    drain, ahead = 0.0, 0.0
    for priority, tokens in enumerate(backlog_tokens):
        ahead += max(0.0, tokens)
        budget = budgets_s[min(priority, len(budgets_s) - 1)]
        if budget <= 0:
            # No bound (the shipped default of the least urgent priority): its backlog may wait in Kafka as long
            # as it takes, so it asks for no drain rate of its own; it still waits ahead of less urgent ones.
            continue
        drain = max(drain, ahead / budget)
    rate = max(0.0, arrival_tokens_per_s) / TARGET_UTILIZATION + drain
    return rate / capacity_tokens_per_s / share


@dataclass(slots=True)
class ArrivalRate:
    """Tokens per second arriving on the owned partitions, over a sliding window. Arrived so far = tokens
    read + tokens unread now; its slope over the window is the offered load. A new assignment changes what
    counts as unread at once, so the window restarts then."""

    window_s: float = ARRIVAL_WINDOW_S
    _samples: deque = field(default_factory=deque)
    _assignment: frozenset = frozenset()

    def observe(self, now: float, tokens_read: float, unread_tokens: float, assignment: frozenset) -> float | None:
        """None until the window holds two samples at least a second apart."""
        if assignment != self._assignment:
            self._assignment = assignment
            self._samples.clear()
        arrived = tokens_read + unread_tokens
        self._samples.append((now, arrived))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, arrived_then = self._samples[0]
        if now - then < 1.0:
            return None
        return max(0.0, (arrived - arrived_then) / (now - then))


@dataclass(slots=True)
class ScaleSignal:
    """The worker's estimate at each control tick (worker.py feeds it; the status report publishes it)."""

    budgets_s: list[float]
    num_partitions: int
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)
    last: float | None = None
    group_arrival_tokens_per_s: float = 0.0
    """The last measured offered load scaled to the whole group: it stands in while the window refills after
    a rebalance, so the estimate does not dip each time the group changes."""

    def update(self, now: float, unread_tokens: float, tokens_read: float, backlog_tokens: list[float],
               capacity_tokens_per_s: float | None, assigned: frozenset) -> float | None:
        share = len(assigned) / self.num_partitions if self.num_partitions else 0.0
        rate = self.arrivals.observe(now, tokens_read, unread_tokens, assigned)
        if rate is None:
            rate = self.group_arrival_tokens_per_s * share
        elif share > 0:
            self.group_arrival_tokens_per_s = rate / share
        self.last = workers_needed(backlog_tokens, self.budgets_s, rate, capacity_tokens_per_s, share)
        return self.last
