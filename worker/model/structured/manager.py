"""`StructuredOutputManager`: every piece of the engine's structured-output state in one place (as vLLM v1's
StructuredOutputManager): the grammar compiler, the requests held back while their grammars compile, and each
running constrained request's matcher.

The engine calls it where a request enters (`add`, then `take_ready` at each step), where a step's logits are
masked (`grammar_bitmask`), and where tokens are applied (`advance`, `check_end`). The contract it keeps: a
constrained request that ends `stop` carries a complete word of its format, one that ends `length` a prefix
the format admits, and anything else ends in error/invalid_request with the reason:

- refused before it runs (grammar.py's compile and probe): a spec the library refuses, a limit exceeded
  while building, an empty language, a forced path that breaks a limit, a compile past its time budget;
- refused at a step: a matcher that entered an error state (a limit reached on the model's path, or no
  continuation left), or a row with no allowed token; its row is left unmasked and the token drawn dropped;
- refused at the end: an end the grammar does not accept (an EOS it refuses, a stop token or stop string
  that cuts the output short, a last token past a limit).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from worker.model.structured.compile import Compiled, GrammarError, GrammarLimits
from worker.model.structured.grammar import CACHE_SIZE, GrammarCompiler, Matcher

GRAMMAR_POLL_S = 0.002
"""While a grammar compiles (on its own thread) and nothing else can run, the engine looks again this often."""


@dataclass(slots=True)
class _Held:
    request_id: str
    payload: Any
    """What the engine keeps with the request until it starts."""
    compiled: Future[Compiled]


class Ready(NamedTuple):
    """A held request whose grammar is settled."""

    payload: Any
    error: str | None
    """None: its matcher is ready and it may run."""


class StructuredOutputManager:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], limits: GrammarLimits,
                 num_threads: int = 1, busy: Callable[[], bool] | None = None, max_rows: int = 0,
                 cache_size: int = CACHE_SIZE) -> None:
        """`busy`: whether the engine has requests running now; `max_rows`: the most rows a step has;
        `cache_size`: distinct grammars kept compiled (GrammarCompiler)."""
        self._busy = busy
        self._cache_size = cache_size
        self._max_rows = max_rows
        self._tokenizer_args = (hf_tokenizer, vocab_size, tuple(eos_token_ids))
        self.limits = limits
        self._num_threads = num_threads
        self._compiler: GrammarCompiler | None = None
        """Created by the first structured-output request (its tokenizer view costs about 0.4 s)."""
        self._held: dict[str, _Held] = {}
        self._settled: deque[str] = deque()
        """Held requests whose compile has settled, appended by the compile's thread (a future's callback): a
        step looks only at these, not at every held request (a thousand hostile formats may be held at once)."""
        self._poll_at: float | None = None
        """When the held requests are looked at next: fixed once asked for, until a step looks (take_ready)."""
        self._matchers: dict[str, Matcher] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            tokenizer, vocab_size, eos_token_ids = self._tokenizer_args
            self._compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, max_workers=self._num_threads,
                                             limits=self.limits, busy=self._busy, max_rows=self._max_rows,
                                             cache_size=self._cache_size)
        return self._compiler

    # ---- requests in ------------------------------------------------------------------------------

    def add(self, request_id: str, kind: str, spec: str, payload: Any, now: float) -> Ready | None:
        """Compile (or find) the request's grammar (kind json_schema, regex or grammar). Settled at once
        (cached): Ready, and a matcher when it may run; otherwise the request is held until `take_ready` hands
        it back."""
        compiler = self.compiler
        compiler.expire(now)
        compiled = compiler.submit(kind, spec)
        held = _Held(request_id, payload, compiled)
        if compiled.done():
            return self._settle(held, compiled)
        self._held[request_id] = held
        compiled.add_done_callback(lambda _future: self._settled.append(request_id))
        return None

    def take_ready(self, now: float) -> list[Ready]:
        """Held requests whose grammar compiled, was refused, or ran past the compile budget (which counts
        from the compile's start, not from the request's arrival: GrammarCompiler.expire)."""
        self._poll_at = None
        if self._compiler is not None:
            self._compiler.expire(now)
        ready = []
        settled = self._settled
        while settled:
            request_id = settled.popleft()
            held = self._held.get(request_id)
            # Not held (aborted), or held again since with a compile still running (a replay): its own callback
            # comes later.
            if held is not None and held.compiled.done():
                del self._held[request_id]
                ready.append(self._settle(held, held.compiled))
        return ready

    def _settle(self, held: _Held, future: Future[Compiled]) -> Ready:
        try:
            compiled = future.result()
        except CancelledError:  # the compiler was closed before the compile started
            return Ready(held.payload, "the grammar compiler was closed")
        if compiled.error is not None:
            return Ready(held.payload, compiled.error)
        self._matchers[held.request_id] = self.compiler.matcher(compiled)
        return Ready(held.payload, None)

    def abort(self, request_ids: list[str]) -> list[Any]:
        """The payloads of the held requests among these, taken out."""
        return [held.payload for request_id in request_ids if (held := self._held.pop(request_id, None)) is not None]

    @property
    def num_held(self) -> int:
        return len(self._held)

    def wake_time(self, now: float) -> float | None:
        """A fixed time, not `now` + the poll interval: asked again after waiting, that would move away each time
        and an engine thread with only compiling requests would never step (its wait never came due)."""
        if not self._held:
            return None
        if self._settled:
            return now
        if self._poll_at is None:
            self._poll_at = now + GRAMMAR_POLL_S
        return self._poll_at

    # ---- a step -----------------------------------------------------------------------------------

    def has_constrained(self) -> bool:
        return bool(self._matchers)

    def grammar_bitmask(self, sampling_ids: list[str], drafts: list[list[int]] | None = None
                        ) -> tuple[list[int], np.ndarray | None, list[tuple[int, str]]]:
        """This step's constrained rows (increasing), their bitmasks ([len(rows), ceil(V / 32)] int32, the
        token_mask layout), and the rows that cannot go on: (row, why). `drafts`, row by row: the drafts that
        row's token is drawn after (a verify step's rows of one request), so its mask is the grammar's there
        (each an admitted_prefix of its request's drafts)."""
        matchers = self._matchers
        rows = [row for row, request_id in enumerate(sampling_ids) if request_id in matchers]
        if not rows:
            return rows, None, []
        states = [matchers[sampling_ids[row]] if not drafts or not drafts[row]
                  else matchers[sampling_ids[row]].after(drafts[row]) for row in rows]
        bitmask, failed = self.compiler.fill_bitmask(states)
        return rows, bitmask, [(rows[i], why) for i, why in failed]

    def admitted_drafts(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The drafts of a constrained request its grammar admits (Matcher.admitted_prefix); all of them for a
        request without one."""
        matcher = self._matchers.get(request_id)
        return token_ids if matcher is None else matcher.admitted_prefix(token_ids)

    def advance(self, request_id: str, token_id: int) -> tuple[bool, str | None]:
        """Apply a running request's new token: (the grammar is complete and the request ends, error)."""
        try:
            return self._matchers[request_id].advance(token_id), None
        except GrammarError as exc:
            return False, str(exc)

    def check_end(self, request_id: str, token_ids: list[int], stop_token_ids: tuple[int, ...] = ()) -> str | None:
        """The scheduler ended the request at these tokens, by an EOS, its length, or (the last token is one
        of stop_token_ids, given only for a stop) a stop token: None when the output is what its format admits
        for that ending, else why not."""
        matcher = self._matchers[request_id]
        try:
            for token_id in token_ids[:-1]:
                matcher.advance(token_id)
            last = token_ids[-1] if token_ids else None
            if last in stop_token_ids:
                if not matcher.is_accepting():  # the stop token is not part of the output
                    return "a stop token ended the output before its format was complete"
                return None
            if last is not None:
                matcher.advance(last)  # an EOS where the grammar is incomplete is refused here
        except GrammarError as exc:
            return str(exc)
        return None

    def check_stop_string(self, request_id: str, text: str) -> str | None:
        """A stop string cut the output to `text`: None when that is still a complete word of the format."""
        if self._matchers[request_id].accepts_text(text):
            return None
        return "a stop string ended the output before its format was complete"

    def finish(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def close(self) -> None:
        """Stops the compiler (its judge processes); held requests stay held (the engine's abort ends them)."""
        compiler, self._compiler = self._compiler, None
        if compiler is not None:
            compiler.close()
