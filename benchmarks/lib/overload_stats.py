"""The pure part of the overload benchmark (benchmarks/bench_overload.py): what became of each request, the
per-priority table, goodput, wasted tokens, predicted vs actual times, 1-second time series and the floors.
No Kafka, no asyncio: the runner fills `RequestLog`s and `StatusSample`s, these functions read them.

Times are seconds since the phase started, on the client's wall clock (status records' `ts_ms` is on the
worker's, the same machine's). A request's deadline counts from when the benchmark asked to send it
(`arrival_s`), so time the client spent backing off counts against it, as it does for a user.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from llm_client.commands.loadstats import percentile

IN_TIME, LATE, MISSING = "completed_in_time", "completed_late", "missing"


@dataclass(slots=True)
class FinalSeen:
    """One final record as the client read it."""

    attempt: int
    status: str
    reason: str
    at_s: float
    """When the client read it."""
    completion_tokens: int = 0
    message: str = ""
    queue_ms: float | None = None
    e2e_ms: float | None = None
    predicted_queue_ms: float | None = None
    predicted_e2e_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class RequestLog:
    request_id: str
    priority: int
    arrival_s: float
    """When the benchmark called submit (the Poisson arrival); the deadline and e2e count from here."""
    timeout_s: float | None
    backoff_s: float = 0.0
    """How long the client held it back (status-based backoff) before writing the record."""
    send_error: str | None = None
    finals: list[FinalSeen] = field(default_factory=list)

    @property
    def final(self) -> FinalSeen | None:
        """The answer a client keeps: the highest attempt's first final."""
        if not self.finals:
            return None
        top = max(f.attempt for f in self.finals)
        return next(f for f in self.finals if f.attempt == top)

    @property
    def num_duplicate_finals(self) -> int:
        """Finals beyond the first within one attempt (a worker must never write these)."""
        return len(self.finals) - len({f.attempt for f in self.finals})

    @property
    def num_extra_attempts(self) -> int:
        """Finals of further attempts: redeliveries (allowed by at-least-once, reported apart)."""
        return max(0, len({f.attempt for f in self.finals}) - 1)

    @property
    def e2e_s(self) -> float | None:
        final = self.final
        return None if final is None else final.at_s - self.arrival_s


@dataclass(slots=True)
class StatusSample:
    """One worker status record, per priority where a list."""

    at_s: float
    queue: list[int]
    """lag + waiting."""
    paused: list[bool]
    shed: list[bool]
    est_wait_s: list[float | None]
    num_running: int = 0
    num_preemptions: int = 0
    """Cumulative, since the worker started."""
    last_step_ms: float = 0.0
    num_steps: int = 0
    """Cumulative, like num_batched_tokens and busy_ms."""
    num_batched_tokens: int = 0
    busy_ms: float = 0.0
    engine_cpu_s: float | None = None
    """CPU seconds the worker's engine thread had used when the client read this record (/proc; cumulative)."""
    other_cpu_s: float | None = None
    """The same for all the worker's other threads together: the asyncio transport, the Kafka clients' I/O."""


def outcome(r: RequestLog) -> str:
    """completed_in_time, completed_late, rejected:<reason>, error:<reason> or missing."""
    if r.send_error is not None:
        return "error:send_failed"
    final = r.final
    if final is None:
        return MISSING
    if final.status == "completed":
        return IN_TIME if r.timeout_s is None or final.at_s <= r.arrival_s + r.timeout_s else LATE
    return f"{final.status}:{final.reason}"


def _pcts(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in qs}


def priority_table(requests: list[RequestLog]) -> dict[str, dict]:
    """Per priority ("0", "1", ... and "all"): sent, outcome counts, in-time fraction, e2e percentiles (s) of
    the completed, and how many were held back by backoff."""
    groups: dict[str, list[RequestLog]] = {}
    for r in sorted(requests, key=lambda r: r.priority):
        groups.setdefault(str(r.priority), []).append(r)
    groups["all"] = list(requests)
    table = {}
    for key, group in groups.items():
        counts = Counter(outcome(r) for r in group)
        done = [r.e2e_s for r in group if outcome(r) in (IN_TIME, LATE)]
        table[key] = {
            "sent": len(group), IN_TIME: counts[IN_TIME], LATE: counts[LATE], MISSING: counts[MISSING],
            "completed": counts[IN_TIME] + counts[LATE],
            "rejected": {k.split(":", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith("rejected:")},
            "error": {k.split(":", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith("error:")},
            "in_time_fraction": counts[IN_TIME] / len(group) if group else None,
            "e2e_s": _pcts(done),
            "num_backed_off": sum(r.backoff_s > 0 for r in group),
            "backoff_s_total": sum(r.backoff_s for r in group),
        }
    return table


def goodput(requests: list[RequestLog], window_s: float) -> dict:
    """Requests completed within their deadline per second while arrivals last. `per_s` counts the finals read
    between the first completion of the phase and the end of the arrival window, over that span: the rate
    of useful work under overload, without the cold start (reported as first_completion_s) and without the
    drain, where completions of work queued earlier would count for seconds in which nothing new arrives
    (with 30 s deadlines they can add up to 30 s of completions to a 60 s window). `incl_drain_per_s`: every
    completion within its deadline over the arrival window, whenever it came."""
    done_at = [r.final.at_s for r in requests if outcome(r) in (IN_TIME, LATE)]
    in_time_at = [r.final.at_s for r in requests if outcome(r) == IN_TIME]
    first = min(done_at, default=None)
    span = None if first is None else window_s - first
    return {"per_s": sum(t <= window_s for t in in_time_at) / span if span and span > 0 else None,
            "incl_drain_per_s": len(in_time_at) / window_s if window_s > 0 else None,
            "first_completion_s": first, "span_s": span}


def engine_summary(statuses: list[StatusSample], start_s: float, end_s: float) -> dict:
    """The engine's work between the status samples nearest start_s and end_s (cumulative counters): steps,
    tokens per step, tokens per busy second, the share of the time it was busy, and the CPU its thread and the
    worker's other threads used per second of the span (where the samples carry it). None where fewer than
    two samples fall in the span."""
    inside = [s for s in statuses if start_s <= s.at_s <= end_s]
    if len(inside) < 2 or inside[-1].num_steps <= inside[0].num_steps:
        return {"span_s": None, "steps": None, "tokens_per_step": None, "tokens_per_busy_s": None,
                "busy_fraction": None}
    first, last = inside[0], inside[-1]
    steps = last.num_steps - first.num_steps
    tokens = last.num_batched_tokens - first.num_batched_tokens
    busy_s = (last.busy_ms - first.busy_ms) / 1000.0
    span_s = last.at_s - first.at_s
    def per_s(a: float | None, b: float | None) -> float | None:
        return (b - a) / span_s if a is not None and b is not None else None

    return {"span_s": span_s, "steps": steps, "tokens_per_step": tokens / steps,
            "tokens_per_busy_s": tokens / busy_s if busy_s > 0 else None, "busy_fraction": busy_s / span_s,
            "engine_cpu_per_s": per_s(first.engine_cpu_s, last.engine_cpu_s),
            "other_cpu_per_s": per_s(first.other_cpu_s, last.other_cpu_s)}


def wasted_tokens(requests: list[RequestLog]) -> dict:
    """Completion tokens of every distinct (request, attempt) final, and the part that reached nobody in time:
    late completions, rejected or errored work (a request stopped at its deadline carries what it made) and
    superseded attempts. Identical repeats of one attempt's final are one piece of work.
    Beside them (no floor): prompt tokens computed (prompt - cached, for finals of requests that were scheduled,
    queue_ms set) and the part computed for requests that did not complete in time."""
    total = wasted = prompt_total = prompt_wasted = 0
    for r in requests:
        kept = r.final if outcome(r) == IN_TIME else None
        for attempt in {f.attempt for f in r.finals}:
            final = next(f for f in r.finals if f.attempt == attempt)
            total += final.completion_tokens
            prompt = max(0, final.prompt_tokens - final.cached_tokens) if final.queue_ms is not None else 0
            prompt_total += prompt
            if final is not kept:
                wasted += final.completion_tokens
                prompt_wasted += prompt
    return {"total": total, "wasted": wasted, "fraction": wasted / total if total else None,
            "prompt_total": prompt_total, "prompt_wasted": prompt_wasted,
            "prompt_fraction": prompt_wasted / prompt_total if prompt_total else None}


def prediction_errors(requests: list[RequestLog]) -> dict[str, dict]:
    """actual / predicted for completed requests that carry predictions: queue (queue_ms / predicted_queue_ms,
    skipped when predicted is 0) and completion (e2e_ms / predicted_e2e_ms); p50 and p90, per priority and all."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in requests:
        final = r.final
        if final is None or final.status != "completed":
            continue
        for key in (str(r.priority), "all"):
            slot = ratios.setdefault(key, {"queue": [], "e2e": []})
            if final.predicted_queue_ms and final.queue_ms is not None:
                slot["queue"].append(final.queue_ms / final.predicted_queue_ms)
            if final.predicted_e2e_ms and final.e2e_ms is not None:
                slot["e2e"].append(final.e2e_ms / final.predicted_e2e_ms)
    return {key: {kind: {"n": len(v), **_pcts(v, (50, 90))} for kind, v in slot.items()}
            for key, slot in sorted(ratios.items(), key=lambda kv: (kv[0] == "all", kv[0]))}


def steady_span(times_s: list[float], warmup: int, end_s: float) -> tuple[int, float, float] | None:
    """Of a closed loop that kept `warmup` requests outstanding until end_s: the completions after the
    `warmup`-th one (by then every request in flight was sent inside the loop, so the worker holds as much
    unfinished work at the span's start as at its end) up to end_s, as (their count, first time, end_s);
    None when fewer than `warmup` + 2 completed before end_s."""
    ordered = sorted(t for t in times_s if t <= end_s)
    if warmup < 1 or len(ordered) < warmup + 2:
        return None
    start = ordered[warmup - 1]
    return len(ordered) - warmup, start, end_s


def capacity_from_completions(times_s: list[float], warmup: int, end_s: float) -> float | None:
    """Steady-state completion rate (requests/s) of a closed loop, over its steady_span."""
    span = steady_span(times_s, warmup, end_s)
    if span is None or span[2] <= span[1]:
        return None
    return span[0] / (span[2] - span[1])


def time_series(requests: list[RequestLog], statuses: list[StatusSample], num_priorities: int,
                end_s: float) -> dict:
    """1-second bins from 0 to end_s. Counts per bin and priority: offered (arrivals), admitted (started
    running: written after the backoff, plus the final's queue_ms), in_time and late (by final arrival),
    rejected[reason]. From status records, per bin: queue (max of lag + waiting), paused and shed (any record
    in the bin says so), running (max); None where no status record fell in the bin."""
    num_bins = max(1, math.ceil(end_s))

    def zeros() -> list[list[int]]:
        return [[0] * num_bins for _ in range(num_priorities)]

    def add(series: list[list[int]], p: int, at_s: float | None) -> None:
        if at_s is not None and 0 <= at_s < num_bins and 0 <= p < num_priorities:
            series[p][int(at_s)] += 1

    out = {"bins_s": list(range(num_bins)), "offered": zeros(), "admitted": zeros(), IN_TIME: zeros(),
           LATE: zeros(), "rejected": {}}
    for r in requests:
        add(out["offered"], r.priority, r.arrival_s)
        final, kind = r.final, outcome(r)
        if final is None:
            continue
        if final.queue_ms is not None:
            add(out["admitted"], r.priority, r.arrival_s + r.backoff_s + final.queue_ms / 1000.0)
        if kind in (IN_TIME, LATE):
            add(out[kind], r.priority, final.at_s)
        elif kind.startswith("rejected:"):
            add(out["rejected"].setdefault(final.reason, zeros()), r.priority, final.at_s)
    per_bin: list[list[StatusSample]] = [[] for _ in range(num_bins)]
    for s in statuses:
        if 0 <= s.at_s < num_bins:
            per_bin[int(s.at_s)].append(s)

    def from_status(pick) -> list[list]:
        return [[pick(samples, p) if samples else None for samples in per_bin] for p in range(num_priorities)]

    out["queue"] = from_status(lambda ss, p: max(s.queue[p] for s in ss))
    out["paused"] = from_status(lambda ss, p: any(s.paused[p] for s in ss))
    out["shed"] = from_status(lambda ss, p: any(s.shed[p] for s in ss))
    out["running"] = [max(s.num_running for s in ss) if ss else None for ss in per_bin]
    # Preemptions per second (from the cumulative count) and the slowest engine step seen in each second.
    preempted = [max(s.num_preemptions for s in ss) if ss else None for ss in per_bin]
    last = 0
    out["preemptions"] = []
    for count in preempted:
        out["preemptions"].append(None if count is None else max(0, count - last))
        last = count if count is not None else last
    out["step_ms"] = [max(s.last_step_ms for s in ss) if ss else None for ss in per_bin]
    # From the cumulative engine counters, per second: steps, tokens per step, tokens per busy second (how
    # much a second of forward got done) and the share of the second the engine was busy.
    last_sample = None
    for key in ("steps_per_s", "tokens_per_step", "tokens_per_busy_s", "busy_fraction"):
        out[key] = []
    for ss in per_bin:
        sample = ss[-1] if ss else None
        steps = tokens = busy_s = span_s = None
        if sample is not None and last_sample is not None and sample.at_s > last_sample.at_s:
            steps = sample.num_steps - last_sample.num_steps
            tokens = sample.num_batched_tokens - last_sample.num_batched_tokens
            busy_s = (sample.busy_ms - last_sample.busy_ms) / 1000.0
            span_s = sample.at_s - last_sample.at_s
        out["steps_per_s"].append(None if steps is None else steps / span_s)
        out["tokens_per_step"].append(tokens / steps if steps else None)
        out["tokens_per_busy_s"].append(tokens / busy_s if busy_s else None)
        out["busy_fraction"].append(None if busy_s is None else busy_s / span_s)
        last_sample = sample if sample is not None else last_sample
    return out


def phase_summary(requests: list[RequestLog], window_s: float, capacity: float | None) -> dict:
    """Every aggregate of one phase."""
    gp = goodput(requests, window_s)
    examples: dict[str, str] = {}
    for r in requests:
        if r.final is not None and r.final.status != "completed":
            examples.setdefault(f"p{r.priority} {outcome(r)}", r.final.message)
    return {
        "num_requests": len(requests), "window_s": window_s, "table": priority_table(requests), "goodput": gp,
        "goodput_over_capacity": gp["per_s"] / capacity if capacity and gp["per_s"] is not None else None,
        "message_examples": dict(sorted(examples.items())),
        "wasted_tokens": wasted_tokens(requests), "prediction_errors": prediction_errors(requests),
        "num_missing": sum(outcome(r) == MISSING for r in requests),
        "num_duplicate_finals": sum(r.num_duplicate_finals for r in requests),
        "duplicate_ids": [r.request_id for r in requests if r.num_duplicate_finals][:20],
        "num_redelivered": sum(r.num_extra_attempts > 0 for r in requests),
    }


IN_TIME_FLOORS = {5.0: {0: 0.99}, 2.0: {0: 0.99, 1: 0.95}}
"""Per overload factor: per priority, the least fraction of sent requests completed within their deadline."""
GOODPUT_FACTOR, GOODPUT_FLOOR, WASTED_CEILING = 5.0, 0.90, 0.05
"""At 5x overload: goodput >= 0.90 x capacity and wasted tokens <= 5 % of tokens generated."""


def _floor(check: str, phase: str, value, floor: str, ok: bool, note: str = "") -> dict:
    return {"check": check, "phase": phase, "value": value, "floor": floor, "pass": bool(ok), "note": note}


def check_floors(phase: str, factor: float | None, summary: dict, offsets_at_end: bool | None) -> list[dict]:
    """The floors of one phase (factor None: the capacity phase, where only the every-phase checks apply)."""
    out = [
        _floor("every request has a final record", phase, summary["num_missing"], "0 missing",
               summary["num_missing"] == 0),
        _floor("no duplicate final within one attempt", phase, summary["num_duplicate_finals"], "0",
               summary["num_duplicate_finals"] == 0, ", ".join(summary["duplicate_ids"][:5])),
        _floor("committed offsets reach the log end", phase, offsets_at_end, "true", offsets_at_end is True),
    ]
    for p, least in IN_TIME_FLOORS.get(factor, {}).items():
        row = summary["table"].get(str(p))
        value = row["in_time_fraction"] if row else None
        out.append(_floor(f"priority {p} completed within deadline", phase, value, f">= {least:.0%} of sent",
                          value is not None and value >= least, "" if row else "no requests of this priority"))
    if factor == GOODPUT_FACTOR:
        ratio = summary["goodput_over_capacity"]
        out.append(_floor("goodput / capacity", phase, ratio, f">= {GOODPUT_FLOOR}",
                          ratio is not None and ratio >= GOODPUT_FLOOR))
        wasted = summary["wasted_tokens"]["fraction"]
        out.append(_floor("wasted tokens / tokens generated", phase, wasted, f"<= {WASTED_CEILING:.0%}",
                          wasted is not None and wasted <= WASTED_CEILING))
    return out
