"""What the demo prints: interleaved streams as prefixed lines, and the overload tables (from the status
topic and from the final records). Pure text building, so the demo's orchestration stays readable."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from schemas.status import WorkerStatus


def say(message: str) -> None:
    """A demo step, timestamped, flushed at once: nothing may look hung."""
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class PrefixedLines:
    """Shows several concurrent streams at once: each stream's text is cut into lines (at newlines, or at
    a space once `width` characters gathered) and every line is printed with the stream's prefix."""

    def __init__(self, prefix: str, width: int = 72, out=None) -> None:
        self.prefix, self.width, self.out = prefix, width, out or sys.stdout
        self.buffer = ""

    def feed(self, text: str) -> None:
        self.buffer += text
        while True:
            newline = self.buffer.find("\n")
            if 0 <= newline <= self.width:
                self._emit(self.buffer[:newline])
                self.buffer = self.buffer[newline + 1:]
                continue
            if len(self.buffer) <= self.width:
                return
            cut = self.buffer.rfind(" ", 0, self.width + 1)
            cut = cut if cut > 0 else self.width
            self._emit(self.buffer[:cut])
            self.buffer = self.buffer[cut:].lstrip(" ")

    def restart(self, attempt: int) -> None:
        self.buffer = ""
        self._emit(f"(attempt {attempt} supersedes the lines above; starting over)")

    def close(self) -> None:
        if self.buffer.strip():
            self._emit(self.buffer)
        self.buffer = ""

    def _emit(self, line: str) -> None:
        print(f"{self.prefix} {line}", file=self.out, flush=True)


@dataclass(slots=True)
class LoadWatch:
    """Peaks seen in the status records of one worker during a phase of the demo."""

    worker_id: str
    num_priorities: int
    num_reports: int = 0
    max_waiting: int = 0
    max_running: int = 0
    max_kv_usage: float = 0.0
    max_lag: list[int] = field(default_factory=list)
    paused_partitions: list[set[int]] = field(default_factory=list)
    shed_reports: list[int] = field(default_factory=list)
    """Per priority: how many reports said it was shed."""

    def __post_init__(self) -> None:
        self.max_lag = [0] * self.num_priorities
        self.paused_partitions = [set() for _ in range(self.num_priorities)]
        self.shed_reports = [0] * self.num_priorities

    def observe(self, status: WorkerStatus) -> None:
        if status.worker_id != self.worker_id:
            return
        self.num_reports += 1
        self.max_waiting = max(self.max_waiting, status.num_waiting)
        self.max_running = max(self.max_running, status.num_running)
        self.max_kv_usage = max(self.max_kv_usage, status.kv_usage)
        for entry in status.priorities:
            if entry.priority < self.num_priorities:
                self.max_lag[entry.priority] = max(self.max_lag[entry.priority], entry.lag)
                self.paused_partitions[entry.priority].update(entry.paused_partitions)
                self.shed_reports[entry.priority] += int(entry.shed)

    def table(self) -> str:
        lines = [f"status topic: {self.num_reports} reports from {self.worker_id}; peak waiting {self.max_waiting}, "
                 f"peak running {self.max_running}, peak KV use {self.max_kv_usage:.0%}",
                 f"  {'priority':>8} {'max backlog':>11} {'paused partitions seen':>23} {'shed (reports)':>15}"]
        for p in range(self.num_priorities):
            paused = ",".join(str(x) for x in sorted(self.paused_partitions[p])) or "-"
            shed = f"yes ({self.shed_reports[p]})" if self.shed_reports[p] else "no"
            lines.append(f"  {p:>8} {self.max_lag[p]:>11} {paused:>23} {shed:>15}")
        return "\n".join(lines)


def shedding_check(outcomes: list[tuple[int, str, str, float | None]], bounds_s: list[float]) -> list[str]:
    """One line per shed priority: whether the worker could have started its requests within the priority's
    queue-time bound. They wait behind every more urgent request, so the more urgent ones' last answer (client
    e2e, all sent at once) is when the first of them could have started. A shed priority whose more urgent work
    was done within the bound was shed on a misestimate, and the line says so."""
    lines = []
    for p, bound in enumerate(bounds_s):
        shed = [o for o in outcomes if o[0] == p and o[2] == "shed"]
        if not shed or bound <= 0:
            continue
        ahead = [o[3] for o in outcomes if o[0] < p and o[1] == "completed" and o[3] is not None]
        busy = max(ahead, default=0.0)
        verdict = ("could not have started within it: shedding told the truth" if busy > bound
                   else "could have started within it: shed on a misestimate")
        lines.append(f"priority {p}: {len(shed)} shed; the more urgent requests took until {busy:.1f} s, against its "
                     f"{bound:g} s queue-time bound, so its requests {verdict}")
    return lines


def outcome_table(outcomes: list[tuple[int, str, str, float | None]], num_priorities: int) -> str:
    """outcomes: (priority, status, reason, client e2e seconds or None). Counts by status/reason per priority."""
    lines = [f"  {'priority':>8} {'sent':>5}  {'outcomes (status/reason: count)':<48} {'e2e p50':>8}"]
    for p in range(num_priorities):
        mine = [o for o in outcomes if o[0] == p]
        counts = Counter(f"{status}/{reason}" for _, status, reason, _ in mine)
        text = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) or "-"
        e2e = sorted(o[3] for o in mine if o[1] == "completed" and o[3] is not None)
        median = f"{e2e[len(e2e) // 2]:.1f} s" if e2e else "-"
        lines.append(f"  {p:>8} {len(mine):>5}  {text:<48} {median:>8}")
    return "\n".join(lines)
