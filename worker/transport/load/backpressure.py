"""Pause and resume decisions for the request partitions, per priority, with hysteresis.

Two independent reasons to pause a priority's partitions:

* **queue**: a priority pauses while more than `max_waiting` requests of it or of more urgent priorities
  wait locally, and resumes once fewer than `resume_waiting` do (between the two watermarks nothing
  changes: hysteresis). This is the intake's fetch rule (intake.py) made visible to producers and to
  aiokafka's prefetcher: a queue full of less urgent work never pauses an urgent priority, and memory stays
  bounded (at most max_waiting + a poll per priority).
* **kv**: KV usage above `kv_pause_threshold` pauses priorities from the least urgent upward, one more level
  per decision while it lasts, down to the most urgent; they resume one level per decision, most urgent
  first, once usage is below `kv_resume_threshold`.
* **priority backlog**: while a more urgent priority has a backlog (its consumer lag plus its locally waiting
  records) above `backlog_threshold`, every less urgent priority is paused, so fetch capacity goes to the
  urgent one. It resumes when every more urgent backlog is at or below half the threshold.

Each priority's pause state changes at most once per `dwell_s` (avoids pause/resume churn that would make
aiokafka drop and refetch its prefetched data), except that a priority never stays readable while a more
urgent one is paused for the same reason: the paused set always runs from some priority to the least urgent.
Pure: no aiokafka, the transport maps priorities to partitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class LoadSnapshot:
    waiting_by_priority: list[int]
    """Per priority: requests in the transport's local queue."""
    kv_usage: float
    backlog_by_priority: list[int]
    """Per priority: consumer lag plus locally waiting requests."""


@dataclass(slots=True, frozen=True)
class PauseDecision:
    paused_priorities: frozenset[int]
    reasons: dict[int, str]
    """priority -> "queue" | "kv" | "priority_backlog" for every paused priority."""


@dataclass(slots=True)
class Backpressure:
    num_priorities: int
    max_waiting: int
    resume_waiting: int
    kv_pause_threshold: float
    kv_resume_threshold: float
    backlog_threshold: int
    dwell_s: float = 0.5
    load_level: int = 0
    """Number of least urgent priorities paused for KV usage (0..num_priorities)."""
    _level_changed_at: float = float("-inf")
    _queue_paused: set[int] = field(default_factory=set)
    _queue_changed_at: dict[int, float] = field(default_factory=dict)
    _backlog_paused: set[int] = field(default_factory=set)
    _backlog_changed_at: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, worker, num_priorities: int) -> "Backpressure":
        return cls(
            num_priorities=num_priorities,
            max_waiting=worker.max_waiting,
            resume_waiting=worker.resume_waiting,
            kv_pause_threshold=worker.kv_pause_threshold,
            kv_resume_threshold=worker.kv_resume_threshold,
            backlog_threshold=worker.priority_backlog_threshold,
            dwell_s=worker.pause_dwell_s,
        )

    def decide(self, load: LoadSnapshot, now: float) -> PauseDecision:
        self._update_kv_level(load, now)
        self._update_queue_pauses(load, now)
        self._update_backlog_pauses(load, now)
        reasons: dict[int, str] = {}
        for priority in sorted(self._backlog_paused):
            reasons[priority] = "priority_backlog"
        # A load pause names its cause even when a backlog pause also holds: load is the stronger reason.
        for priority in sorted(self._queue_paused):
            reasons[priority] = "queue"
        for priority in range(self.num_priorities - self.load_level, self.num_priorities):
            reasons[priority] = "kv"
        return PauseDecision(frozenset(reasons), reasons)

    def _update_kv_level(self, load: LoadSnapshot, now: float) -> None:
        if now - self._level_changed_at < self.dwell_s:
            return
        if load.kv_usage > self.kv_pause_threshold and self.load_level < self.num_priorities:
            self.load_level += 1
            self._level_changed_at = now
        elif load.kv_usage < self.kv_resume_threshold and self.load_level > 0:
            self.load_level -= 1
            self._level_changed_at = now

    def _update_queue_pauses(self, load: LoadSnapshot, now: float) -> None:
        ahead = 0
        more_urgent_paused = False
        for priority, waiting in enumerate(load.waiting_by_priority):
            ahead += waiting
            self._step(self._queue_paused, self._queue_changed_at, priority, now, more_urgent_paused,
                       want_pause=ahead > self.max_waiting, want_resume=ahead < self.resume_waiting)
            more_urgent_paused = priority in self._queue_paused

    def _update_backlog_pauses(self, load: LoadSnapshot, now: float) -> None:
        backlog = load.backlog_by_priority
        for priority in range(1, self.num_priorities):
            more_urgent = backlog[:priority]
            self._step(self._backlog_paused, self._backlog_changed_at, priority, now,
                       more_urgent_paused=priority - 1 in self._backlog_paused,
                       want_pause=any(b > self.backlog_threshold for b in more_urgent),
                       want_resume=all(b <= self.backlog_threshold // 2 for b in more_urgent))

    def _step(self, paused: set[int], changed_at: dict[int, float], priority: int, now: float,
              more_urgent_paused: bool, want_pause: bool, want_resume: bool) -> None:
        """One priority's pause state for one reason. A priority never fetches while a more urgent one is paused
        for the same reason: it pauses with it even inside its dwell time, and resumes only after it (without
        this, per-priority dwell clocks let a less urgent priority resume first)."""
        is_paused = priority in paused
        if more_urgent_paused and not is_paused:
            paused.add(priority)
            changed_at[priority] = now
            return
        if now - changed_at.get(priority, float("-inf")) < self.dwell_s:
            return
        if want_pause and not is_paused:
            paused.add(priority)
            changed_at[priority] = now
        elif want_resume and is_paused and not more_urgent_paused:
            paused.discard(priority)
            changed_at[priority] = now
