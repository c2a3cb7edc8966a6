"""Load control: from each priority's consumer lag, the local queue and the engine's KV usage, decide which
priorities are shed and which are paused, and whether input has ended for now. It returns a `LoadDecision`;
the intake applies it (pause/resume, answering newly shed requests), the dispatcher passes the end of input
to the engine and the status reporter publishes it. Pure: no aiokafka, no clock of its own.

Backlog of a priority = the part of its lag expected to reach the engine (shedding.ReachFraction) plus its
requests waiting in the local queue; shedding and the priority-backlog pause both use it, shedding in tokens
(each unread record priced like the recent requests of its priority, service_model.py). Shedding is decided before
pausing: a shed priority is never paused, because its records are answered at once and consuming them is
what drains its lag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from worker.transport.load.backpressure import Backpressure, LoadSnapshot
from worker.transport.load.service_model import ServiceModel
from worker.transport.load.shedding import ShedDecision, Shedder

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class LoadDecision:
    lag_by_priority: list[int]
    backlog_by_priority: list[int]
    shed: ShedDecision
    newly_shed: frozenset[int]
    """Priorities shed now that were not at the previous decision: their waiting requests are answered."""
    pause_reasons: dict[int, str]
    """priority -> "queue" | "kv" | "priority_backlog" for every priority whose partitions are to be paused."""
    input_ended: bool
    """Nothing unread in the assigned partitions and nothing waiting locally: the consumer has caught up."""
    unread_tokens: float = 0.0
    """Expected tokens of the unread records expected to reach the engine (the autoscaling signal's input)."""

    @property
    def shed_priorities(self) -> frozenset[int]:
        return self.shed.shed_priorities

    def shed_message(self, priority: int) -> str:
        return self.shed.message(priority)


class LoadControl:
    def __init__(self, shedder: Shedder, backpressure: Backpressure, service: ServiceModel) -> None:
        self.shedder = shedder
        self.backpressure = backpressure
        self.service = service
        self._shed_before: frozenset[int] = frozenset()

    def decide(
        self, lag_by_priority: list[int], waiting_by_priority: list[int], kv_usage: float, now: float,
        reach_fractions: list[float] | None = None, waiting_tokens: list[float] | None = None,
    ) -> LoadDecision:
        """`reach_fractions`: per priority, the share of unread records expected to reach the engine
        (shedding.ReachFraction); None counts them all. `waiting_tokens`: per priority, the expected tokens of
        the requests waiting locally; None prices them like unread records."""
        fractions = reach_fractions or [1.0] * len(lag_by_priority)
        unread = [round(lag * fraction) for lag, fraction in zip(lag_by_priority, fractions)]
        backlog = [n + waiting for n, waiting in zip(unread, waiting_by_priority)]
        costs = [self.service.mean_cost(p) or 0.0 for p in range(len(lag_by_priority))]
        local = waiting_tokens or [n * cost for n, cost in zip(waiting_by_priority, costs)]
        engine = self.service.engine_waiting_by_priority()
        tokens = [(n + e) * cost + t for n, e, cost, t in zip(unread, engine, costs, local)]
        shed = self.shedder.decide(backlog, tokens, self.service.capacity_tokens_per_s())
        newly_shed = shed.shed_priorities - self._shed_before
        self._shed_before = shed.shed_priorities
        if newly_shed:
            log.warning("shedding priorities %s: %s", sorted(shed.shed_priorities),
                        [shed.message(p) for p in sorted(shed.shed_priorities)])
        pauses = self.backpressure.decide(LoadSnapshot(list(waiting_by_priority), kv_usage, backlog), now)
        pause_reasons = {p: r for p, r in pauses.reasons.items() if p not in shed.shed_priorities}
        return LoadDecision(
            lag_by_priority=list(lag_by_priority), backlog_by_priority=backlog, shed=shed, newly_shed=newly_shed,
            pause_reasons=pause_reasons, input_ended=sum(lag_by_priority) + sum(waiting_by_priority) == 0,
            unread_tokens=sum(n * cost for n, cost in zip(unread, costs)),
        )
