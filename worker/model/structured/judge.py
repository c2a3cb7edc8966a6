"""The second pass of a grammar compile: a judge process that compiles a grammar under the full limits and
says whether it may run, so that the cost of refusing a pathological format is paid outside the worker.

GrammarCompiler (grammar.py) settles nearly every grammar in its first pass, on a thread, under cut limits.
A grammar refused there on a cut limit (lexer fuel, parser items) is either large but legitimate (a
50,000-value enum) or pathological (`a{1000000}`, a required recursive `$ref`); only the full limits tell,
and reaching them costs up to a second of CPU. That compile runs here, in a child process:

- at the lowest CPU priority (SCHED_IDLE, and nice 19 where that is refused): the forward pass keeps the
  cores, and the judge takes only the time they would idle;
- it shares no lock with the worker (the GIL, the allocator's arenas), so a starved compile never holds up
  the worker's threads;
- it yields the cores to the forward pass: while the engine has requests running, a judge with a grammar runs
  in slices, `JUDGE_BUSY_SHARE` of each `JUDGE_BUSY_PERIOD_S`, and is stopped (SIGSTOP) in between. Idle
  priority alone leaves it every moment a core would idle, and a forward pass on two threads has many such
  moments (each op's threads wait for each other); each one the judge takes costs the next op a wake-up, a
  cold cache and memory bandwidth. Paced, the judges cost the forward pass at most their slices;
- it can be stopped: past the compile budget in CPU seconds (`ENGINE_GRAMMAR_COMPILE_TIMEOUT_S`), or past
  `WALL_FACTOR` times it in wall time since a judge took the grammar (starved of CPU), it is killed and the
  grammar refused; the next grammar starts a fresh judge. A grammar that waits `WALL_FACTOR` budgets for a
  judge (behind a flood of others) is refused without one. Those two refusals say nothing of the grammar:
  the same spec is judged again when sent after a while (`Compiled.retry_at`). A thread running the library
  cannot be stopped, only abandoned;
- a crash of the library on a hostile grammar ends the judge, not the worker: the grammar is refused.

The verdict is a message or none. A grammar the judge passes is compiled again in the worker, under the full
limits, since a compiled matcher cannot cross processes; that costs what the judge measured, within the budget.

Protocol (one JSON object per line): the worker sends the tokenizer and limits, the judge answers
`{"ready": true}`; then per grammar `{"kind", "spec"}`, answered `{"error": message or null}`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from copy import copy
from dataclasses import asdict
from pathlib import Path
from typing import Callable
from weakref import WeakMethod

from worker.model.structured.compile import (WALL_FACTOR, Compiled, GrammarLimits, compile_timeout_message,
                                             first_step_error, library_grammar, lower_priority, starved_message)

log = logging.getLogger(__name__)

JUDGE_WALL_FACTOR = WALL_FACTOR
"""A grammar is refused after this many compile budgets of wall time waiting for a judge, and again after as
many while a judge has it (starved of CPU: the cores busy with normal-priority work). Either bounds its wait,
and neither counts against the grammar (Compiled.retry_at)."""
CLOSED = "the grammar compiler was closed"
JUDGE_START_TIMEOUT_S = 120.0
"""A judge that has not read its tokenizer by then (about 0.5 s of CPU at idle priority) is killed."""
JUDGE_BUSY_SHARE = 0.1
"""While the engine has requests running, the fraction of wall time a judge with a grammar may run (module
docstring). Beside a flood of 1,000 distinct formats to judge, unpaced idle-priority judges added 2.5-3.0 s
of CPU to the engine thread's 11.5 s for 100 ordinary requests; paced, 0.9-1.8 s (docs/structured-output.md).
A grammar needing its whole CPU budget takes 1 / JUDGE_BUSY_SHARE budgets of wall time while the engine is
busy, which is JUDGE_WALL_FACTOR's bound: past it, it is refused as starved and may be sent again. 1:
unpaced."""
JUDGE_BUSY_PERIOD_S = 0.1
"""The pacing period: short enough that a grammar's wait moves in small steps, long enough that stopping and
continuing a process (two signals) costs nothing beside it."""
_ROOT = str(Path(__file__).resolve().parents[2])
_JUDGE_MAIN = """import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
parent = os.getppid()
try:  # killed with the worker, even while stopped for the forward pass
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
except (AttributeError, OSError):
    pass
if os.getppid() != parent:
    sys.exit(0)
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from worker.model.structured.judge import main
main()
"""
"""The judge's entry: bound to die with its worker, and at idle priority, before its imports (about 0.1 s of
CPU: llguidance and numpy)."""


class JudgePool:
    """Judge processes, each fed by a thread of the worker, taking the second passes in arrival order. A
    judge starts at its first grammar (its tokenizer view costs about 0.5 s of idle CPU) and is kept."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], limits: GrammarLimits,
                 processes: int, build: Callable[[str, str], Compiled] | WeakMethod,
                 busy: Callable[[], bool] | None = None) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.busy = busy
        """Whether the engine has requests running now (the judges are paced while it does); None: never."""
        self._eos = list(eos_token_ids) or hf_tokenizer.eos_token_id
        self._vocab_size = vocab_size
        self.limits = limits
        self._build = build
        self._setup: bytes | None = None
        self._setup_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, str, Future[Compiled], float] | None] = queue.SimpleQueue()
        self._closed = False
        self.num_killed = 0
        self.num_expired = 0
        """Grammars refused past their wall time before a judge took them."""
        self.num_starved = 0
        """Grammars refused past their wall time while a judge had them."""
        self.num_paused = 0
        """Times a judge was stopped for the forward pass."""
        self._judges = [_Judge(self) for _ in range(max(1, processes))]
        self._threads = [threading.Thread(target=self._serve, args=(judge,), name="grammar-judge", daemon=True)
                         for judge in self._judges]
        for thread in self._threads:
            thread.start()

    def submit(self, kind: str, spec: str, future: Future[Compiled]) -> None:
        self._jobs.put((kind, spec, future, time.monotonic()))

    def close(self) -> None:
        """Ends the judges now: their processes are killed (a grammar being judged is refused, as are those
        queued), and their threads end."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for judge in self._judges:
            judge.kill()

    @property
    def pids(self) -> list[int]:
        """The judge processes running now."""
        return [judge.pid for judge in self._judges if judge.pid is not None]

    def setup_line(self) -> bytes:
        with self._setup_lock:
            if self._setup is None:
                # As llguidance.hf.from_tokenizer does, so the judge's token view is the worker's.
                backend = copy(self._hf_tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._setup = (json.dumps({"tokenizer": backend.to_str(), "vocab_size": self._vocab_size,
                                           "eos": self._eos, "limits": asdict(self.limits)}) + "\n").encode()
            return self._setup

    def _built(self, kind: str, spec: str) -> Compiled:
        """The grammar built in the worker after a judge passed it. The compiler is held only in this frame:
        this thread must not keep a dropped one alive (its finalizer closes this pool)."""
        build = self._build() if isinstance(self._build, WeakMethod) else self._build
        return Compiled(None, CLOSED) if build is None else build(kind, spec)

    def _serve(self, judge: _Judge) -> None:
        lower_priority()  # the rebuild of a passed grammar runs here, like a first pass
        wall = JUDGE_WALL_FACTOR * self.limits.compile_timeout_s
        try:
            while (job := self._jobs.get()) is not None:
                kind, spec, future, sent = job
                if self._closed:
                    future.set_result(Compiled(None, CLOSED))
                    continue
                now = time.monotonic()
                if now - sent >= wall:
                    self.num_expired += 1
                    future.set_result(Compiled(None, (
                        f"the grammar waited {now - sent:.1f} s for a judge process behind other grammars that "
                        f"need the full limits (worker limit {JUDGE_WALL_FACTOR} x ENGINE_GRAMMAR_COMPILE_TIMEOUT_S="
                        f"{self.limits.compile_timeout_s:g} s) and was not compiled, which says nothing of it; it "
                        "may be sent again later"), retry_at=now + wall))
                    continue
                try:
                    error = judge.ask(kind, spec, now + wall)
                    if self._closed:
                        future.set_result(Compiled(None, CLOSED))
                    elif isinstance(error, Compiled):
                        future.set_result(error)
                    elif error is not None:
                        future.set_result(Compiled(None, error))
                    else:
                        future.set_result(self._built(kind, spec))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(exc)
        finally:
            judge.stop()


class _Judge:
    """One judge process, as seen from its feeding thread."""

    def __init__(self, pool: JudgePool) -> None:
        self._pool = pool
        self._proc: subprocess.Popen | None = None
        self._in_process = False
        """Set when no process could be started: the worker's full compile judges (the old single pass)."""
        self._paused = False
        """Stopped (SIGSTOP) for the forward pass: continued before its feeding thread does anything else."""

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.poll() is not None else proc.pid

    def kill(self) -> None:
        """From another thread (close): the process ends; its feeding thread sees that and reaps it."""
        proc = self._proc
        if proc is not None:
            try:
                proc.kill()
            except OSError:
                pass

    def ask(self, kind: str, spec: str, deadline: float) -> str | Compiled | None:
        """The judge's refusal of (kind, spec) (a message, or a Compiled for a refusal that says nothing of the
        grammar), or None when it may run (or when no judge could be started)."""
        if self._in_process:
            return None
        if self._proc is None and not self._start():
            return None if self._in_process else "compiling the grammar failed: its judge process did not start"
        proc = self._proc
        try:
            proc.stdin.write((json.dumps({"kind": kind, "spec": spec}) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            self.stop()
            return "compiling the grammar ended its process"
        cpu_start, wall_start = _cpu_seconds(proc.pid), time.monotonic()
        try:
            return self._await_verdict(kind, spec, deadline, cpu_start, wall_start)
        finally:
            self._resume()

    def _await_verdict(self, kind: str, spec: str, deadline: float, cpu_start: float | None,
                       wall_start: float) -> str | Compiled | None:
        limits = self._pool.limits
        proc = self._proc
        while True:
            line = self._read_paced()
            if line is not None:
                if not line:  # the library crashed on this grammar (or the judge was killed from outside)
                    code = self.stop()
                    if self._pool._closed:
                        return CLOSED
                    log.warning("the grammar judge exited (code %s) compiling a %s of %d chars", code, kind,
                                len(spec))
                    return f"compiling the grammar ended its process (exit code {code})"
                return json.loads(line)["error"]
            cpu = _cpu_seconds(proc.pid)
            used = (cpu - cpu_start) if cpu is not None and cpu_start is not None else None
            wall = time.monotonic() - wall_start
            budget = limits.compile_timeout_s
            over_cpu = (used if used is not None else wall) > budget
            if over_cpu or time.monotonic() >= deadline:
                self.stop()
                self._pool.num_killed += 1
                log.info("grammar judge killed past the budget (%s, %d chars, %.2f s CPU, %.2f s)", kind,
                         len(spec), used if used is not None else float("nan"), wall)
                if not over_cpu:  # starved: the CPU it had is not the reason
                    self._pool.num_starved += 1
                    return Compiled(None, starved_message(limits, wall, used, " in its judge process",
                                                          JUDGE_WALL_FACTOR),
                                    retry_at=time.monotonic() + JUDGE_WALL_FACTOR * budget)
                return compile_timeout_message(limits, used if used is not None else wall,
                                               " of CPU" if used is not None else "")

    def _read_paced(self) -> bytes | None:
        """The judge's next line within a pacing period (None if none came), the judge stopped for the rest of
        the period past its slice while the engine is busy."""
        self._resume()
        busy = self._pool.busy
        if busy is None or JUDGE_BUSY_SHARE >= 1 or not busy():
            return self._read_line(0.05)
        line = self._read_line(JUDGE_BUSY_SHARE * JUDGE_BUSY_PERIOD_S)
        if line is not None:
            return line
        if self._signal(signal.SIGSTOP):
            self._paused = True
            self._pool.num_paused += 1
        # A line written just before the stop is still read here.
        return self._read_line((1 - JUDGE_BUSY_SHARE) * JUDGE_BUSY_PERIOD_S)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> bool:
        proc = self._proc
        if proc is None:
            return False
        try:
            proc.send_signal(signum)  # nothing once the process is reaped (Popen polls first)
        except OSError:
            return False
        return proc.returncode is None

    def _read_line(self, timeout: float) -> bytes | None:
        """A line from the judge (b"" at its end), or None when none came within the timeout."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else None

    def _start(self) -> bool:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
        if self._pool._closed:
            return False
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _JUDGE_MAIN], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env, cwd=_ROOT)
            if self._pool._closed:  # closed while it started: close() may have missed it
                self._proc.kill()
            self._proc.stdin.write(self._pool.setup_line())
            self._proc.stdin.flush()
        except OSError as exc:
            log.warning("no grammar judge process (%s): grammars past the first pass compile in the worker", exc)
            self.stop()
            self._in_process = True
            return False
        deadline = time.monotonic() + JUDGE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self._read_line(0.1)
            if line is None:
                continue
            if line and json.loads(line).get("ready"):
                return True
            break
        log.warning("the grammar judge did not start (code %s)", self.stop())
        return False

    def stop(self) -> int | None:
        proc, self._proc = self._proc, None
        self._paused = False  # killed below if still running: SIGKILL ends a stopped process too
        if proc is None:
            return None
        try:
            proc.stdin.close()
        except OSError:
            pass
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        proc.stdout.close()
        return code


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of a process (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---- the judge process ----------------------------------------------------------------------------


def main() -> None:
    import llguidance


    # The protocol owns the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    line = sys.stdin.readline()
    if not line.endswith("\n"):  # the worker closed it while it started
        return
    setup = json.loads(line)
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"], eos_token=setup["eos"])
    limits = GrammarLimits(**setup["limits"])
    parser_limits = limits.parser_limits()
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        grammar = library_grammar(job["kind"], job["spec"])
        if isinstance(grammar, Compiled):
            error = grammar.error
        else:
            error = first_step_error(llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits),
                           setup["vocab_size"])
            error = limits.explain(error) if error else None
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()


