"""Rate limits on repeated log records (worker/log_limits.py): a flood is cut to a few lines and a count.

A fake clock drives the intervals, so these run in milliseconds; one test goes through `llm-worker`'s real
logging setup in a subprocess.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading

import pytest

from worker.log_limits import SUMMARY_ATTR, LogLimitSettings, RepeatLimiter, install_repeat_limits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def handler(clock: FakeClock) -> ListHandler:
    handler = ListHandler()
    limiter = RepeatLimiter(handler.handle, max_repeats=5, interval_s=10.0, clock=clock, background_flush=False)
    handler.addFilter(limiter)
    return handler


@pytest.fixture
def logger(handler: ListHandler, request: pytest.FixtureRequest) -> logging.Logger:
    logger = logging.getLogger(f"test.log_limits.{request.node.name}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield logger
    logger.removeHandler(handler)


def limiter_of(handler: logging.Handler) -> RepeatLimiter:
    return next(f for f in handler.filters if isinstance(f, RepeatLimiter))


def test_a_flood_of_one_template_is_cut_to_the_limit_and_one_summary(
    logger: logging.Logger, handler: ListHandler, clock: FakeClock
) -> None:
    start = clock.now
    for attempt in range(1000):
        clock.now = start + attempt * 0.005  # 1,000 records in 5 s: one interval
        logger.error("Unable connect to node with id %s: attempt %d", 1, attempt)
    assert handler.messages() == [f"Unable connect to node with id 1: attempt {i}" for i in range(5)]
    clock.now = start + 10.0
    assert limiter_of(handler).flush_expired() == 1
    summary = handler.records[-1]
    assert getattr(summary, SUMMARY_ATTR)
    assert summary.getMessage() == (
        "Unable connect to node with id 1: attempt 999 (message repeated 995 more times in the last 10 s)"
    )
    assert (summary.name, summary.levelno) == (logger.name, logging.ERROR)
    assert limiter_of(handler).flush_expired() == 0  # a summary is written once


def test_different_templates_loggers_and_levels_do_not_interfere(
    handler: ListHandler, logger: logging.Logger, clock: FakeClock
) -> None:
    other_logger = logging.getLogger(logger.name + ".other")
    for i in range(20):
        logger.error("first template %d", i)
        logger.error("second template %d", i)
        logger.warning("first template %d", i)  # same template, other level: its own key
        other_logger.error("first template %d", i)  # propagates to `logger`'s handler under its own name
    counts: dict[tuple[str, int, str], int] = {}
    for record in handler.records:
        key = (record.name, record.levelno, record.msg)
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 4 and set(counts.values()) == {5}
    clock.now += 10.0
    assert limiter_of(handler).flush_expired() == 4
    assert sorted(r.getMessage() for r in handler.records[-4:]) == sorted(
        ["first template 19 (message repeated 15 more times in the last 10 s)"] * 3
        + ["second template 19 (message repeated 15 more times in the last 10 s)"]
    )


def test_the_summary_comes_before_the_first_record_of_the_next_interval_which_passes_again(
    logger: logging.Logger, handler: ListHandler, clock: FakeClock
) -> None:
    for i in range(12):
        logger.warning("fetch failed (%r)", i)
    assert len(handler.records) == 5
    clock.now += 10.0  # the next interval: no flush call, the record itself reports the one before
    for i in range(7):
        logger.warning("fetch failed (%r)", 100 + i)
    assert handler.messages()[5:] == [
        "fetch failed (11) (message repeated 7 more times in the last 10 s)",
        *[f"fetch failed ({100 + i})" for i in range(5)],
    ]
    clock.now += 10.0
    assert limiter_of(handler).flush_expired() == 1
    assert handler.messages()[-1] == "fetch failed (106) (message repeated 2 more times in the last 10 s)"


def test_info_and_debug_pass_untouched(logger: logging.Logger, handler: ListHandler) -> None:
    for i in range(100):
        logger.info("progress %d", i)
        logger.debug("detail %d", i)
    assert len(handler.records) == 200


def test_an_interval_without_drops_writes_no_summary(
    logger: logging.Logger, handler: ListHandler, clock: FakeClock
) -> None:
    for _ in range(5):
        logger.error("exactly the limit")
    clock.now += 10.0
    assert limiter_of(handler).flush_expired() == 0
    assert len(handler.records) == 5


def test_ended_keys_are_forgotten_while_other_records_flow(logger: logging.Logger, clock: FakeClock) -> None:
    # f-strings make a new key per record; the once-per-interval sweep keeps the dict to the keys of the last
    # two intervals (here 100 records each) instead of every key ever seen.
    limiter = next(f for h in logger.handlers for f in h.filters if isinstance(f, RepeatLimiter))
    start = clock.now
    for i in range(1000):
        clock.now = start + i * 0.1
        logger.error(f"unique {i}")
    assert limiter.num_keys <= 200


def test_counts_stay_exact_across_threads(logger: logging.Logger, handler: ListHandler, clock: FakeClock) -> None:
    def flood() -> None:
        for i in range(2000):
            logger.error("from a thread %d", i)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    clock.now += 10.0
    limiter_of(handler).flush_expired()
    assert len(handler.records) == 6
    assert handler.messages()[-1].endswith("(message repeated 7995 more times in the last 10 s)")


def test_flush_all_reports_an_unfinished_interval(
    logger: logging.Logger, handler: ListHandler, clock: FakeClock
) -> None:
    for _ in range(8):
        logger.error("cut short by exit")
    clock.now += 4.0
    assert limiter_of(handler).flush_all() == 1
    assert handler.messages()[-1] == "cut short by exit (message repeated 3 more times in the last 4 s)"


def test_install_is_idempotent_and_off_at_zero() -> None:
    handler = ListHandler()
    assert len(install_repeat_limits([handler], LogLimitSettings(max_repeats=3))) == 1
    assert install_repeat_limits([handler], LogLimitSettings(max_repeats=3)) == []
    assert len(handler.filters) == 1 and limiter_of(handler).max_repeats == 3
    assert install_repeat_limits([ListHandler()], LogLimitSettings(max_repeats=0)) == []


def test_llm_worker_logging_is_limited() -> None:
    # main() through to the handler basicConfig makes; a few hundred errors come out as five and a summary.
    script = (
        "import logging, sys\n"
        "from worker import cli\n"
        "cli.SUBCOMMANDS['flood'] = ('tests.test_log_limits', 'test only')\n"
        "sys.exit(cli.main(['flood']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(error_lines) == 6, proc.stderr
    # Written at exit, before the interval ended: it names the time it covers.
    assert re.search(r"broker down \(message repeated 295 more times in the last \d+ s\)$", error_lines[-1])


# `llm-worker flood`, for the subprocess test above.
def configure_parser(parser: object) -> None:
    pass


def run(args: object) -> int:
    for _ in range(300):
        logging.getLogger("aiokafka.conn").error("broker down")
    return 0


def test_aiokafka_leader_elections_are_logged_at_info_and_other_errors_are_not():
    """A normal start (topics created just before the worker joins) must not print ERROR lines for a leader that
    is still being elected; aiokafka retries those itself. Any other aiokafka error keeps its level."""
    import io

    from worker.log_limits import install_transient_downgrade

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    install_transient_downgrade([handler])
    fetcher = logging.getLogger("aiokafka.consumer.fetcher")
    fetcher.addHandler(handler)
    try:
        fetcher.error("Failed fetch offsets from 1: [Error 6] NotLeaderForPartitionError: %s", "tp")
        fetcher.error("Failed fetch messages from 1: NodeNotReadyError: node 1")
        logging.getLogger("worker.x").addHandler(handler)
        logging.getLogger("worker.x").error("NotLeaderForPartitionError in our own code stays an error")
    finally:
        fetcher.removeHandler(handler)
        logging.getLogger("worker.x").removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("INFO aiokafka.consumer.fetcher Failed fetch offsets")
    assert lines[1].startswith("ERROR aiokafka.consumer.fetcher Failed fetch messages")
    assert lines[2].startswith("ERROR worker.x")
