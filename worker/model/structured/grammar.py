"""Structured output: grammars compiled by llguidance, a matcher per constrained request, and each
step's token bitmask for the rows that are constrained.

Why llguidance (benchmarks/bench_structured.py, figures in docs/benchmarks.md): on SmolLM2's 49152-token vocabulary it
compiled each of the five test schemas in under 1 ms (xgrammar 0.7-12 ms); every one of its 128 outputs on
random logits parsed and validated, where 8 of xgrammar's 86 did not (it ignored multipleOf on a number, and once
let a raw control byte into a string); and it installs 8 MB with no dependencies (xgrammar 16 MB, and requires
torch, transformers and triton). xgrammar fills masks faster (0.17 against 0.8-1.2 ms for 16 rows); either is a
few percent of a CPU step at 32 running.

Compiling is cheap but not free (building llguidance's view of the tokenizer takes about 0.4 s, once per
engine; a large schema can take much longer than ours), so it runs on a small thread pool and never inside a
step: `GrammarCompiler.submit` returns a future, and the engine holds a request back until its grammar is
ready. Results, failures included, are kept in an LRU cache keyed by (kind, spec): a distinct grammar is
compiled once, and each request gets a copy of its compiled, pristine matcher (about 20 µs; building one
costs 0.4-1 ms).

JSON is generated compact and in one line: `", "` between items, `": "` after keys, no other whitespace
outside strings (vLLM's `disable_any_whitespace`): a small model given free whitespace may emit newlines
until its token budget runs out, which no grammar can then complete.

A grammar is refused at compile time, before its request runs, when the library can tell: a spec it cannot
read, a limit of `GrammarLimits` exceeded while building it, an empty language (the first mask allows no
token, or only an EOS while the grammar is not complete: llguidance then enters an error state), or a path
every output is forced along (fast-forward tokens) that breaks a limit, such as `(a{1000}){1000}` or a
required recursive `$ref`. (The plainest shapes of those two, `a{1000000}` and a `$ref` cycle through required
properties, are refused before the library sees them, from their text: grammar_screen.py.) The probe
computes the first mask on the pristine matcher, so that cost is paid here and the copies start with a warm
lexer. Reaching a limit is what makes a refusal expensive (a second of CPU for `(a{1000}){1000}` at the
default lexer fuel), so it is first tried at cut limits, and only what those cannot settle goes to a judge
process (GrammarCompiler, grammar_judge.py). What only shows while generating (a limit
reached after the model's own choices) is a `GrammarError` at that step (engine/structured_output.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

import llguidance
import llguidance.numpy
import numpy as np

from worker.model.structured.compile import (WALL_FACTOR, Compiled, GrammarError,
                                             GrammarLimits, bitmask_width, compile_timeout_message, first_step_error,
                                             library_grammar, lower_priority, starved_message)
from worker.model.structured.screen import screen

if TYPE_CHECKING:
    from worker.model.structured.judge import JudgePool

log = logging.getLogger(__name__)

CACHE_SIZE = 64
"""Distinct grammars kept compiled (failures included); the engine passes ENGINE_GRAMMAR_CACHE_SIZE."""
COMPILE_CPU_SHARE = 0.02
"""CPU seconds per second of wall time that first passes may take at COMPILE_NICE; past it (a flood of
distinct formats) they run at SCHED_IDLE, on what the forward pass leaves idle. Even a tenth of a core at
nice 10 costs a two-thread forward pass far more than a tenth: its threads wait for each other at every op,
and the compile thread takes the GIL in between (1,000 distinct hostile formats, about 1.7 s of first
passes: ordinary throughput 0.62 of alone at nice 10, 0.93 at SCHED_IDLE, on the engine alone). The share
still lets about 10 ordinary schemas a second through at nice 10 whatever the flood."""
COMPILE_CPU_BURST_S = 0.2
"""CPU seconds of first passes that may run at COMPILE_NICE at once after a quiet spell."""
MAX_ABANDONED = 8
"""Compiles past their time budget whose threads may still run while others take their slots."""
JUDGE_PROCESSES = 2
"""Judge processes for the second pass (grammar_judge.py); 0: one pass at the full limits, on the thread."""


class Matcher:
    """One request's position in its grammar, advanced by each token it generates."""

    __slots__ = ("_matcher", "_compiled", "_eos_token_ids", "_limits", "_tokenizer")

    def __init__(self, compiled: Compiled, eos_token_ids: tuple[int, ...], limits: GrammarLimits | None = None,
                 tokenizer: llguidance.LLTokenizer | None = None) -> None:
        assert compiled.matcher is not None, compiled.error
        self._compiled = compiled
        self._matcher = compiled.matcher.deep_copy()
        self._eos_token_ids = eos_token_ids
        self._limits = limits or GrammarLimits()
        self._tokenizer = tokenizer

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; True when the request ends here: the grammar is complete and admits no
        further token, or it was complete and the token is an EOS (which ends it even for a request that
        ignores EOS). Raises GrammarError when the matcher refuses the token or reaches an error state on it
        (a limit the model's path ran into; the mask let through only tokens the grammar allows)."""
        matcher = self._matcher
        if not matcher.consume_token(token_id):
            raise GrammarError(self._limits.explain(matcher.get_error() or f"the grammar refused token {token_id}"))
        return matcher.is_stopped() or (token_id in self._eos_token_ids and matcher.is_accepting())

    def admitted_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (drafts) the grammar admits from here, short of a token that would end
        the request (advance True): after each of those a next token is still drawn under the grammar."""
        probe = self._matcher.deep_copy()
        for i, token_id in enumerate(token_ids):
            if token_id in self._eos_token_ids or not probe.consume_token(token_id) or probe.is_error() \
                    or probe.is_stopped():
                return token_ids[:i]
        return token_ids

    def after(self, token_ids: list[int]) -> "Matcher":
        """A copy of this matcher having consumed `token_ids` (an admitted prefix): the state a draft's row is
        drawn in. This one is left as it is."""
        fork = object.__new__(Matcher)
        fork._compiled, fork._eos_token_ids = self._compiled, self._eos_token_ids
        fork._limits, fork._tokenizer = self._limits, self._tokenizer
        fork._matcher = self._matcher.deep_copy()
        fork._matcher.consume_tokens(token_ids)
        return fork

    @property
    def error(self) -> str | None:
        """The matcher's error, once it is in an error state (a mask computation can put it there), else None."""
        return self._limits.explain(self._matcher.get_error()) if self._matcher.is_error() else None

    def is_accepting(self) -> bool:
        """The output so far is complete: a word of the grammar."""
        return self._matcher.is_accepting()

    def accepts_text(self, text: str) -> bool:
        """Whether `text`, read from the grammar's start, is a complete word of it (for output cut by a stop
        string, which need not end on a token boundary)."""
        if self._tokenizer is None:
            return False
        fresh = self._compiled.matcher.deep_copy()
        return fresh.consume_tokens(self._tokenizer.tokenize_str(text)) and fresh.is_accepting()

    @property
    def handle(self) -> llguidance.LLMatcher:
        return self._matcher


class GrammarCompiler:
    """Compiles grammars off the engine's thread and keeps them; fills the bitmasks of a step's matchers.

    Two passes. The first, on a niced thread of this process, builds and probes the grammar with the lexer
    fuel and parser items cut to `GrammarLimits.quick` (every ordinary format fits; a pathological one is
    refused there in milliseconds instead of the second a full-fuel refusal of `a{1000000}` costs). What the
    first pass settles is final, except a refusal on a cut limit: that grammar goes to the second pass, a
    judge process (grammar_judge.py) that compiles it under the full limits at the lowest CPU priority
    (SCHED_IDLE) and is killed past the compile budget in CPU seconds. A grammar the judge passes is then
    built here under the full limits (its cost now known to fit the budget). So a flood of distinct
    pathological formats costs the forward pass only the first passes; their full refusals take CPU only
    when the cores would idle, and a runaway compile is truly stopped, where a thread cannot be."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_workers: int = 1,
                 cache_size: int = CACHE_SIZE, limits: GrammarLimits | None = None,
                 judge_processes: int | None = None, busy: Callable[[], bool] | None = None,
                 max_rows: int = 0) -> None:
        """`busy`: whether the engine has requests running now; the judges yield to it (grammar_judge.py).
        `max_rows`: the most matchers a step fills at once (the engine's max_num_seqs)."""
        self.vocab_size = vocab_size
        self._busy = busy
        self.eos_token_ids = tuple(eos_token_ids)
        self.limits = limits or GrammarLimits()
        self._parser_limits = self.limits.parser_limits()
        if judge_processes is None:
            judge_processes = JUDGE_PROCESSES
        quick = self.limits.quick()
        self._quick = quick if judge_processes > 0 and quick != self.limits else None
        """The first pass's limits; None: one pass, at the full limits, on the compile thread."""
        self._quick_parser_limits = quick.parser_limits()
        self._cache: OrderedDict[tuple[str, bytes], Future[Compiled]] = OrderedDict()
        """Keyed by a digest of the spec: a format may be up to a megabyte of text."""
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, str, Future[Compiled]]] = deque()
        self._running: dict[Future[Compiled], tuple[float, int | None, float]] = {}
        """First passes on a thread: their start (time.monotonic()), and once running their thread's CPU clock
        and its reading when the compile began (compile threads outlive their compiles)."""
        self._cpu_credit = COMPILE_CPU_BURST_S
        self._credit_at = time.monotonic()
        self._launches: queue.SimpleQueue = queue.SimpleQueue()
        # Compile threads are started by this thread, never by a compile thread: a thread inherits its
        # creator's scheduling class, and one at SCHED_IDLE may not go back without privilege.
        threading.Thread(target=_launcher, args=(self._launches, max_workers), name="grammar-launcher",
                         daemon=True).start()
        weakref.finalize(self, self._launches.put, None)  # a compiler dropped unclosed stops its threads
        self._num_slots = max_workers
        self._num_abandoned = 0
        """Compiles past the budget whose threads still run (the library cannot be interrupted)."""
        self._closed = False
        # Off the caller's thread too: about 0.4 s for a 49k vocabulary, once.
        self._tokenizer: Future = Future()
        threading.Thread(target=_run_into, name="grammar-tokenizer", daemon=True, args=(
            self._tokenizer, _llg_tokenizer, hf_tokenizer, vocab_size, list(eos_token_ids) or None),
        ).start()
        self._hf_tokenizer = hf_tokenizer
        self._judges: JudgePool | None = None
        self._num_judges = judge_processes
        self._executor = llguidance.LLExecutor()
        # Made and touched at its largest now, on the engine's thread: grown later by a burst, it would be carved
        # from the engine thread's arena above whatever that step left alive there (docs/memory.md).
        self._bitmask = np.zeros((max_rows, bitmask_width(vocab_size)), dtype=np.int32)
        self._bitmask.fill(0)
        self.num_compiled = 0
        self.num_judged = 0
        """Grammars the first pass could not settle, sent to the judge."""

    def submit(self, kind: str, spec: str) -> Future[Compiled]:
        """The compiled grammar of (kind, spec), from the cache or compiled on a grammar thread, in the order
        asked. Call from one thread."""
        key = (kind, hashlib.blake2b(spec.encode(), digest_size=16).digest())
        future = self._cache.get(key)
        if future is not None and not _may_retry(future):
            self._cache.move_to_end(key)
            return future
        future = Future()
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)  # a future still running finishes for whoever holds it
        with self._lock:
            self._queue.append((kind, spec, future))
        self._start_queued()
        return future

    def expire(self, now: float) -> None:
        """Ends every first pass past the time budget with a refusal and gives its slot to the next compile in
        the queue: one pathological grammar delays the others by the budget at most. The budget counts the
        compile thread's CPU seconds (its refusal is kept in the cache, so the same spec is refused at once from
        then on); a compile starved of CPU (WALL_FACTOR budgets of wall time) is refused for a while only
        (`Compiled.retry_at`). Its thread runs on, unused, until the library's own limits end it; at most
        `MAX_ABANDONED` such threads at a time, past that a slot waits for its compile. (A second pass keeps
        its own budget: JudgePool.)"""
        budget = self.limits.compile_timeout_s
        if not self._running:  # asked at every step: no lock while nothing compiles
            return
        with self._lock:
            overdue = []
            for future, (start, clock, base) in self._running.items():
                cpu = _clock_seconds(clock)
                if cpu is None and clock is not None:
                    continue  # its thread just ended: its own result comes
                cpu = None if cpu is None else cpu - base
                if cpu is not None and cpu > budget:
                    overdue.append((future, Compiled(None, compile_timeout_message(self.limits, cpu, " of CPU"))))
                elif now - start > WALL_FACTOR * budget or (clock is None and _NO_CPU_CLOCK and now - start > budget):
                    overdue.append((future, Compiled(None, starved_message(self.limits, now - start, cpu),
                                                     retry_at=now + WALL_FACTOR * budget)))
            for future, refusal in overdue:
                if self._num_abandoned >= MAX_ABANDONED:
                    break
                del self._running[future]
                self._num_abandoned += 1
                self._num_slots += 1
                future.set_result(refusal)
        if overdue:
            self._start_queued()

    def _start_queued(self) -> None:
        starts = []
        with self._lock:
            while self._num_slots > 0 and self._queue and not self._closed:
                kind, spec, future = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                self._num_slots -= 1
                self._running[future] = (time.monotonic(), None, 0.0)
                starts.append((kind, spec, future))
        for kind, spec, future in starts:
            shared = self._take_cpu_share()
            self._launches.put((self._run, (kind, spec, future, shared), not shared))

    def _take_cpu_share(self) -> bool:
        """Whether the next first pass may run at COMPILE_NICE (within COMPILE_CPU_SHARE), else at SCHED_IDLE."""
        with self._lock:
            now = time.monotonic()
            self._cpu_credit = min(COMPILE_CPU_BURST_S,
                                   self._cpu_credit + (now - self._credit_at) * COMPILE_CPU_SHARE)
            self._credit_at = now
            return self._cpu_credit > 0

    def _run(self, kind: str, spec: str, future: Future[Compiled], shared: bool) -> Callable[[], None]:
        """On a compile thread at COMPILE_NICE (`shared`) or at SCHED_IDLE; returns what settles the compile,
        which the thread calls once it waits for the next one (_compile_thread)."""
        clock = _thread_clock()
        with self._lock:
            if future in self._running:
                self._running[future] = (self._running[future][0], clock, _clock_seconds(clock) or 0.0)
        cpu = time.thread_time()
        try:
            result = self._compile(kind, spec)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            result = exc
        return functools.partial(self._settle, kind, spec, future, result, time.thread_time() - cpu if shared else 0.0)

    def _settle(self, kind: str, spec: str, future: Future[Compiled], result, cpu_s: float) -> None:
        """A first pass's outcome to its future (or to the judges), its slot to the next compile queued."""
        with self._lock:
            self._cpu_credit -= cpu_s
            if self._running.pop(future, None) is None:  # the budget gave up on it: its refusal stands
                self._num_abandoned -= 1
                return
            self._num_slots += 1
            if result is _SECOND_PASS and not self._closed:
                self.num_judged += 1
                self._judge_pool().submit(kind, spec, future)
            elif result is _SECOND_PASS:
                future.set_result(Compiled(None, "the grammar compiler was closed"))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._start_queued()

    def _judge_pool(self) -> JudgePool:
        from worker.model.structured.judge import JudgePool

        if self._judges is None:  # under self._lock
            # A weak reference back: the pool's threads must not keep a dropped compiler alive, so that its
            # finalizer stops the judges.
            self._judges = JudgePool(self._hf_tokenizer, self.vocab_size, self.eos_token_ids, self.limits,
                                     self._num_judges, weakref.WeakMethod(self._full_compile), self._busy)
            weakref.finalize(self, self._judges.close)
        return self._judges

    def _compile(self, kind: str, spec: str) -> Compiled | object:
        """The first pass: a Compiled, or _SECOND_PASS for a refusal on a limit the quick limits cut."""
        tokenizer = self._tokenizer.result()
        start = time.thread_time()
        refusal = screen(kind, spec)  # only here: a judge or a full build gets a spec that already passed it
        grammar = Compiled(None, refusal) if refusal is not None else library_grammar(kind, spec)
        if isinstance(grammar, Compiled):
            compiled = grammar
        elif self._quick is not None:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._quick_parser_limits)
            error = first_step_error(matcher, self.vocab_size)
            cut = GrammarLimits.limit_named(error) if error else None
            if cut is not None and getattr(self._quick, cut) < getattr(self.limits, cut):
                log.debug("grammar %s (%d chars) past the first pass's %s: judged", kind, len(spec), cut)
                return _SECOND_PASS
            compiled = Compiled(None, self.limits.explain(error)) if error else self._build(tokenizer, grammar)
        else:
            compiled = self._build(tokenizer, grammar)
        return self._log(kind, spec, compiled, time.thread_time() - start)

    def _full_compile(self, kind: str, spec: str) -> Compiled:
        """The grammar built here under the full limits (after the judge passed it)."""
        start = time.thread_time()
        grammar = library_grammar(kind, spec)
        compiled = grammar if isinstance(grammar, Compiled) else self._build(self._tokenizer.result(), grammar)
        return self._log(kind, spec, compiled, time.thread_time() - start)

    def _log(self, kind: str, spec: str, compiled: Compiled, seconds: float) -> Compiled:
        """`seconds`: CPU seconds of the compiling thread."""
        if compiled.error is None and seconds > self.limits.compile_timeout_s:
            compiled = Compiled(None, self.compile_timeout_message(seconds))
        if compiled.error is not None:
            log.info("grammar refused (%s, %d chars, %.3f s): %s", kind, len(spec), seconds, compiled.error)
        else:
            self.num_compiled += 1
            log.debug("grammar compiled (%s, %d chars) in %.2f ms", kind, len(spec), seconds * 1e3)
        return compiled

    def compile_timeout_message(self, seconds: float) -> str:
        return compile_timeout_message(self.limits, seconds, " of CPU")

    def _build(self, tokenizer, grammar: str) -> Compiled:
        """Matcher and probe under the full limits; the probe's first mask warms the pristine matcher's lexer."""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._parser_limits)
        error = first_step_error(matcher, self.vocab_size)
        return Compiled(None, self.limits.explain(error)) if error else Compiled(matcher)

    def matcher(self, compiled: Compiled) -> Matcher:
        """A fresh matcher at the start of the grammar (a copy of the compiled one)."""
        return Matcher(compiled, self.eos_token_ids, self.limits, self._tokenizer.result())

    def fill_bitmask(self, matchers: list[Matcher]) -> tuple[np.ndarray, list[int]]:
        """The next-token bitmasks of these matchers ([R, ceil(V / 32)] int32, bit t of row i set when token t
        is allowed after matchers[i]; a buffer the next call reuses), computed by llguidance's thread pool
        without the GIL; and the rows that cannot go on, (row, why): a matcher in an error state, or no token
        allowed at all. Their bits are all set instead; their requests must end, their tokens be dropped."""
        rows = len(matchers)
        if self._bitmask.shape[0] < rows:
            self._bitmask = np.empty((max(rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]), np.int32)
        bitmask = self._bitmask[:rows]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m.handle, i) for i, m in enumerate(matchers)], bitmask)
        failed = {int(i): "no token can continue the output" for i in np.flatnonzero(~bitmask.any(axis=1))}
        for i, m in enumerate(matchers):
            # A matcher in an error state allows only EOS, which would end its request as if complete.
            if m.handle.is_error():
                failed[i] = m.error
        for i in failed:
            bitmask[i] = -1
        return bitmask, sorted(failed.items())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queued, self._queue = self._queue, deque()
        for _, _, future in queued:
            future.cancel()
        self._launches.put(None)
        if self._judges is not None:
            self._judges.close()


_SECOND_PASS = object()
"""The first pass's verdict on a grammar refused on a limit it cut: the judge decides."""


def _launcher(launches: queue.SimpleQueue, num_slots: int) -> None:
    """Hands each compile to a waiting compile thread of its class (COMPILE_NICE or SCHED_IDLE), starting one
    when none waits. The threads outlive their compiles, so each keeps the glibc arena it was given, and the
    grammars it builds (alive in the cache for minutes) stay there, away from the forward pass's temporaries
    (docs/memory.md). Each class starts with a thread per slot, while the worker starts; a later one starts
    only beside an abandoned compile, so a burst of distinct formats never brings a thread with a fresh arena
    to fill with grammars while the old ones' arenas are left half empty. The thread that has waited longest
    takes the next compile: compiles go round a class's threads, and each arena holds its share of the cached
    grammars whichever thread a burst kept busy. (With the thread that waited least first, a burst could leave
    another thread the one in use, and the cache's grammars moved to its arena over the next minutes while the
    old arena, pinned by the few compiled there since, gave back less than half: +9 MB in a soak.)"""
    waiting: dict[bool, deque[queue.SimpleQueue]] = {False: deque(), True: deque()}
    """Per class (SCHED_IDLE or not): the job queues of its threads waiting for a compile, longest first."""
    stopped = threading.Event()
    for idle in waiting:
        for _ in range(num_slots):
            waiting[idle].append(_start_compile_thread(waiting[idle], idle, stopped))
    # No compile is held in this frame while it waits: a dropped compiler must be collectable (its finalizer
    # stops its judges and this thread).
    while _launch(launches.get(), waiting, stopped):
        pass
    stopped.set()  # a thread busy now ends after its compile; those waiting end here
    for threads in waiting.values():
        while threads:
            threads.popleft().put(None)


def _launch(launch, waiting: dict[bool, deque[queue.SimpleQueue]], stopped: threading.Event) -> bool:
    if launch is None:
        return False
    fn, args, idle = launch
    try:
        jobs = waiting[idle].popleft()
    except IndexError:  # every thread of the class is busy: a compile was abandoned to its budget
        jobs = _start_compile_thread(waiting[idle], idle, stopped)
    jobs.put((fn, args))
    return True


def _start_compile_thread(waiting: deque[queue.SimpleQueue], idle: bool, stopped: threading.Event) -> queue.SimpleQueue:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_compile_thread, args=(jobs, waiting, idle, stopped), name="grammar", daemon=True).start()
    return jobs


def _compile_thread(jobs: queue.SimpleQueue, waiting: deque[queue.SimpleQueue], idle: bool,
                    stopped: threading.Event) -> None:
    # A thread's first allocation from glibc's malloc binds it to an arena for life; made at once, while few
    # threads exist, it finds one of its own (past the cap, glibc hands out the arenas in use in turn).
    first = bytearray(4096)  # past Python's small-object allocator: a malloc
    del first
    lower_priority(idle)
    while (job := jobs.get()) is not None:
        then = job[0](*job[1])
        del job  # it holds the compiler, which must stay collectable while this thread waits
        # Waiting again before `then` frees the compile's slot: the next compile it starts finds this thread.
        waiting.append(jobs)
        then()
        del then
        if stopped.is_set() and jobs.empty():  # after joining the waiting: the launcher's last look finds it
            return                              # or this does; a compile handed over before the stop still runs


def _thread_clock() -> int | None:
    """The calling thread's CPU clock (Linux), readable from other threads; None where there is none."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _clock_seconds(clock: int | None) -> float | None:
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has ended
        return None


_NO_CPU_CLOCK = not hasattr(time, "pthread_getcpuclockid")
"""Where threads' CPU clocks cannot be read, the first pass's budget is wall time (as it was)."""


def _may_retry(future: Future[Compiled]) -> bool:
    """A cached refusal that said nothing of the grammar, past its retry time: compile the spec again."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return False
    retry_at = future.result().retry_at
    return retry_at is not None and time.monotonic() >= retry_at


WORD_CACHE_FILL = 12_000
"""Distinct words run through llguidance's tokenizer when it is built: more than its word cache holds."""


def _llg_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int] | None) -> llguidance.LLTokenizer:
    # Imported here: llguidance.hf imports transformers, which the judge process (grammar_judge.py) must not
    # pay for (a second of CPU and 100 MB each time one starts).
    import llguidance.hf

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)
    fill_word_cache(tokenizer)
    return tokenizer


def fill_word_cache(tokenizer: llguidance.LLTokenizer, num_words: int = WORD_CACHE_FILL) -> None:
    """Fill the word cache of llguidance's tokenizer to its bound now, with words no format will have.

    llguidance rebuilds the Rust tokenizer from its JSON, which does not carry the worker's cache setting
    (load_tokenizer turns the cache off), and tokenizes each grammar's literals with it: a JSON schema's
    property names, a regex's fixed text. The Rust library keeps every new word, up to 10,000 (2-3 MB by
    the words' length) and never evicts one. Distinct formats (a property name per request) filled it for
    hours, about 225 bytes each: 6,000 distinct schemas grew glibc's heap 1.36 MB, and 0.06 MB once it was
    full. Full from the start, it holds the same 2-3 MB and a later word is tokenized without being kept
    (60 ms, once). The words are letters only: a pre-tokenizer splits digits off a word (Llama 3's into
    groups of three), so numbered words would be too few distinct ones."""
    tokenizer.tokenize_str("".join(f" llg{_letters(i)}" for i in range(num_words)))


def _letters(i: int) -> str:
    """i written in the letters a-z (a distinct word for each i)."""
    out = chr(97 + i % 26)
    while i >= 26:
        i //= 26
        out += chr(97 + i % 26)
    return out


def _run_into(future: Future, fn, *args) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)


