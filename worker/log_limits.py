"""Rate limits for repeated log records: a broker outage must not bury the log in reconnect errors.

While Kafka is down, aiokafka (and our transport) log the same few lines many times a second: 6,000 to
97,000 ERROR lines a minute were reported, 195,000 to 445,000 in tests/transport/test_outage_kafka.py's
minute. `RepeatLimiter`, a filter on a handler, lets through at most `max_repeats` records per key per
interval, where the key is logger name + level + the message template (`record.msg`, before its args are
formatted, so "node 1" and "node 2" count as one line). The rest are dropped and counted; when the interval
ends, one line says how many were dropped:
"<last dropped message> (message repeated K more times in the last T s)". Nothing is dropped silently.

Cost per record below `min_level`: one comparison. At or above it: a dict lookup under a lock (the engine
thread logs too). A daemon thread, started at the first drop, writes the summaries when their interval ends
even if nothing else is logged; whoever installed the limiter calls `flush_all()` when the program ends.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic_settings import BaseSettings, SettingsConfigDict


class LogLimitSettings(BaseSettings):
    """Limits on repeated log records, for every `llm-worker` command."""

    model_config = SettingsConfigDict(env_prefix="LLM_WORKER_LOG_", extra="ignore", use_attribute_docstrings=True)

    max_repeats: int = 5
    """Records let through per key (logger, level, message template) per interval; 0 turns limiting off."""
    repeat_interval_s: float = 60.0
    """Length of one counting interval in seconds; the dropped count is reported when it ends. A broker
    outage keeps about six keys flooding (aiokafka's reconnect, metadata, fetch and coordinator errors),
    so a key costs up to max_repeats + 1 lines per interval: with 10 s a one-minute outage still logged
    206 ERROR lines, with 60 s it logs about 50."""
    min_level: str = "WARNING"
    """Records below this level pass untouched (INFO and DEBUG carry progress, not reconnect floods)."""


SUMMARY_ATTR = "repeat_summary"  # set on the summary records: the limiter lets them through as they are


@dataclass(slots=True)
class _Window:
    start: float
    num_passed: int = 0
    num_dropped: int = 0
    last_dropped: logging.LogRecord | None = None


class RepeatLimiter(logging.Filter):
    """At most `max_repeats` records per key per `interval_s`; the dropped ones are counted and summarised.

    `emit` writes a summary record (a handler's `handle`); it is never called with the lock held, so a
    handler that logs from inside cannot deadlock with us.
    """

    def __init__(
        self,
        emit: Callable[[logging.LogRecord], object],
        *,
        max_repeats: int = 5,
        interval_s: float = 60.0,
        min_level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
        background_flush: bool = True,
    ) -> None:
        super().__init__()
        assert max_repeats >= 1 and interval_s > 0, (max_repeats, interval_s)
        self.max_repeats = max_repeats
        self.interval_s = interval_s
        self.min_level = min_level
        self._emit = emit
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str], _Window] = {}
        self._background_flush = background_flush
        self._next_sweep = clock() + interval_s
        self._flusher: threading.Thread | None = None

    @property
    def num_keys(self) -> int:
        """Keys counted now: those of the current interval and of the one before at most."""
        return len(self._windows)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level or SUMMARY_ATTR in record.__dict__:  # no getattr: a miss raises
            return True
        template = record.msg if isinstance(record.msg, str) else str(record.msg)  # a dict or an exception
        key = (record.name, record.levelno, template)
        now = self._clock()
        ended: list[_Window] = []
        start_flusher = False
        with self._lock:
            if now >= self._next_sweep:  # once per interval: keeps the dict as small as the live keys
                ended = self._pop_ended(now)
            window = self._windows.get(key)
            if window is None or now - window.start >= self.interval_s:
                if window is not None:
                    ended.append(window)
                window = self._windows[key] = _Window(start=now)
            if window.num_passed < self.max_repeats:
                window.num_passed += 1
                passed = True
            else:
                window.num_dropped += 1
                window.last_dropped = record
                passed = False
                # Not while the interpreter shuts down: a thread started then never runs, and start() waits for it
                # for good (an "exception never retrieved" logged by the garbage collector at exit hung there).
                start_flusher = self._background_flush and self._flusher is None and not sys.is_finalizing()
                if start_flusher:
                    self._flusher = threading.Thread(target=self._flush_forever, name="log-repeat-flush", daemon=True)
        self._write_summaries(ended)  # before this record: they are about intervals that ended before it
        if start_flusher:
            self._flusher.start()
        return passed

    def flush_expired(self) -> int:
        """Write the summaries of intervals that have ended and forget those windows; returns how many."""
        with self._lock:
            windows = self._pop_ended(self._clock())
        return self._write_summaries(windows)

    def _pop_ended(self, now: float) -> list[_Window]:
        ended_keys = [key for key, window in self._windows.items() if now - window.start >= self.interval_s]
        self._next_sweep = now + self.interval_s
        return [self._windows.pop(key) for key in ended_keys]

    def flush_all(self) -> int:
        """Write every pending summary now, ended interval or not: at the end of a program."""
        now = self._clock()
        with self._lock:
            windows = list(self._windows.values())
            self._windows.clear()
        return self._write_summaries(windows, now)

    def _write_summaries(self, windows: Iterable[_Window], now: float | None = None) -> int:
        """`now` given: some windows may not have ended, so each summary names the time it covers."""
        num_written = 0
        for window in windows:
            if window.num_dropped:
                span_s = self.interval_s if now is None else min(self.interval_s, now - window.start)
                self._emit(self._summary(window, span_s))
                num_written += 1
        return num_written

    def _summary(self, window: _Window, span_s: float) -> logging.LogRecord:
        last = window.last_dropped
        try:
            message = last.getMessage()
        except (TypeError, ValueError):  # args that do not fit the template: the handler would have said so
            message = f"{last.msg!s} {last.args!r}"
        return logging.makeLogRecord({
            "name": last.name, "levelno": last.levelno, "levelname": last.levelname, "pathname": last.pathname,
            "lineno": last.lineno, "funcName": last.funcName, "module": last.module, "filename": last.filename,
            "msg": "%s (message repeated %d more times in the last %.0f s)",
            "args": (message, window.num_dropped, span_s), SUMMARY_ATTR: True,
        })  # fmt: skip

    def _flush_forever(self) -> None:
        # Real time, not self._clock: a test's fake clock calls flush_expired itself.
        while True:
            time.sleep(min(1.0, self.interval_s / 2))
            self.flush_expired()


def install_repeat_limits(
    handlers: Iterable[logging.Handler], settings: LogLimitSettings | None = None
) -> list[RepeatLimiter]:
    """Put a `RepeatLimiter` on each handler that has none (each counts what it writes); none when limiting is off."""
    settings = settings or LogLimitSettings()
    if settings.max_repeats <= 0:
        return []
    min_level = logging.getLevelName(settings.min_level.upper())
    if not isinstance(min_level, int):
        raise ValueError(f"LLM_WORKER_LOG_MIN_LEVEL: unknown level {settings.min_level!r}")
    limiters = []
    for handler in handlers:
        if any(isinstance(f, RepeatLimiter) for f in handler.filters):
            continue
        limiter = RepeatLimiter(handler.handle, max_repeats=settings.max_repeats,
                                interval_s=settings.repeat_interval_s, min_level=min_level)
        handler.addFilter(limiter)
        limiters.append(limiter)
    return limiters


TRANSIENT_KAFKA_ERRORS = ("NotLeaderForPartitionError", "LeaderNotAvailableError", "NotLeaderOrFollower")
"""Errors aiokafka logs at ERROR or WARNING while a partition's leader is being elected (topics just created, a
broker restarting). The client retries them itself; they are news to no one."""


class TransientKafkaErrors(logging.Filter):
    """Logs aiokafka's retriable leader-election errors at INFO: a normal start (topics created just before the
    worker joins) printed three ERROR lines that said nothing was wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and record.name.startswith("aiokafka"):
            text = record.getMessage()
            if any(name in text for name in TRANSIENT_KAFKA_ERRORS):
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install_transient_downgrade(handlers: Iterable[logging.Handler]) -> None:
    """Put a TransientKafkaErrors filter first on each handler (before a RepeatLimiter counts the record)."""
    for handler in handlers:
        if not any(isinstance(f, TransientKafkaErrors) for f in handler.filters):
            handler.filters.insert(0, TransientKafkaErrors())
