"""The stages of a request this worker read, and the table of those not ended yet. Pure (no Kafka, no asyncio).

    READ ──> QUEUED ──> IN_ENGINE ──> ANSWERED
      │        │  ^          │
      │        v  │          └──────> GIVEN_UP
      │        HELD ────────────────> GIVEN_UP
      └──────────────────────────────> ANSWERED   (from READ, QUEUED too)

READ: decoded and being checked. QUEUED: in the local queue. HELD: its partition was revoked and the rebalance
has not said yet whether it stays. IN_ENGINE: handed to the engine; its streams publish. ANSWERED: its final
was written (completed, error, rejected, shed, deadline, cancelled, dead letter). GIVEN_UP: its partition
went to another worker, or the drain timed out: this worker writes nothing more for it, and its offset stays
uncommitted so that the next owner answers it.

The table answers a question no part of the path could answer alone: has this request ended? A second final
for the same read of a request record would be a second answer to a read_committed consumer, and a final
after it was given up would race the new owner's; both are refused here and counted as violations (a bug).
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    READ = "read"
    QUEUED = "queued"
    HELD = "held"
    IN_ENGINE = "in_engine"
    ANSWERED = "answered"
    GIVEN_UP = "given_up"


ENDED = frozenset({Stage.ANSWERED, Stage.GIVEN_UP})
MOVES: dict[Stage, frozenset[Stage]] = {
    Stage.READ: frozenset({Stage.QUEUED}),
    Stage.QUEUED: frozenset({Stage.HELD, Stage.IN_ENGINE}),
    Stage.HELD: frozenset({Stage.QUEUED}),
    Stage.IN_ENGINE: frozenset(),
}
"""The moves between live stages; every live stage may end (RequestBook.answered, given_up), but a HELD request
is only given up or put back: its partition is not this worker's to answer for until the assignment."""


class RequestBook:
    """Every request read and not ended yet, by its engine id (unique per read of a record), with its stage on
    the request itself (QueuedRequest.stage)."""

    def __init__(self, on_violation=lambda: None) -> None:
        self.live: dict[str, object] = {}
        self.num_answered = 0
        self.num_given_up = 0
        self.violations: list[str] = []
        """What went against the stages (the last 100); each is also logged and passed to on_violation."""
        self._on_violation = on_violation

    def __len__(self) -> int:
        return len(self.live)

    def by_stage(self) -> dict[str, int]:
        counts = {stage.value: 0 for stage in Stage if stage not in ENDED}
        for queued in self.live.values():
            counts[queued.stage.value] += 1
        return counts

    def read(self, queued) -> None:
        queued.stage = Stage.READ
        self.live[queued.engine_id] = queued

    def move(self, queued, stage: Stage) -> None:
        if stage not in MOVES.get(queued.stage, ()):
            self._violation(f"request {queued.engine_id}: {queued.stage.value} -> {stage.value}")
        queued.stage = stage

    def answered(self, queued) -> bool:
        """The request's final is about to be written: True, and it has ended; False when it had ended already
        (the final must not go out) or is held (not this worker's to answer for now)."""
        if queued.stage in ENDED or queued.stage is Stage.HELD:
            self._violation(f"request {queued.engine_id}: answered while {queued.stage.value}")
            return False
        self._end(queued, Stage.ANSWERED)
        self.num_answered += 1
        return True

    def given_up(self, queued) -> None:
        """Nothing more is written for it here (its completions may be given up one by one: once is enough)."""
        if queued.stage in ENDED:
            return
        self._end(queued, Stage.GIVEN_UP)
        self.num_given_up += 1

    def _end(self, queued, stage: Stage) -> None:
        queued.stage = stage
        self.live.pop(queued.engine_id, None)

    def _violation(self, what: str) -> None:
        log.error("request lifecycle violated (a bug): %s", what)
        self.violations = [*self.violations[-99:], what]
        self._on_violation()
