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
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

log = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Distinct grammars kept compiled (failures included)."""
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options: one-line JSON (module docstring)."""


@dataclass(slots=True, frozen=True)
class Compiled:
    """A compiled grammar: a pristine matcher to copy for each request, or the library's error message."""

    matcher: llguidance.LLMatcher | None
    error: str | None = None


class Matcher:
    """One request's position in its grammar, advanced by each token it generates."""

    __slots__ = ("_matcher", "_eos_token_ids")

    def __init__(self, compiled: Compiled, eos_token_ids: tuple[int, ...]) -> None:
        assert compiled.matcher is not None, compiled.error
        self._matcher = compiled.matcher.deep_copy()
        self._eos_token_ids = eos_token_ids

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; True when the request ends here: the grammar is complete and admits no
        further token, or it was complete and the token is an EOS (which ends it even for a request that
        ignores EOS). Raises when the grammar refuses the token: the mask let through only tokens it accepts,
        so that is a bug, not a user error."""
        matcher = self._matcher
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
        return matcher.is_stopped() or (token_id in self._eos_token_ids and matcher.is_accepting())

    @property
    def handle(self) -> llguidance.LLMatcher:
        return self._matcher


class GrammarCompiler:
    """Compiles grammars off the engine's thread and keeps them; fills the bitmasks of a step's matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_workers: int = 1,
                 cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Compiled]] = OrderedDict()
        self._cache_size = cache_size
        # Built on the pool too: about 0.4 s for a 49k vocabulary, once.
        self._tokenizer = self._pool.submit(
            llguidance.hf.from_tokenizer, hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()
        self._bitmask = np.empty((0, bitmask_width(vocab_size)), dtype=np.int32)
        self.num_compiled = 0

    def submit(self, kind: str, spec: str) -> Future[Compiled]:
        """The compiled grammar of (kind, spec), from the cache or compiled on the pool. Call from one thread."""
        key = (kind, spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, kind, spec)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)  # a future still running finishes for whoever holds it
        return future

    def _compile(self, kind: str, spec: str) -> Compiled:
        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        try:
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            elif kind == "grammar":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec)
            else:
                return Compiled(None, f"unknown grammar kind {kind!r}")
        except ValueError as exc:  # a schema that is not a JSON object
            return Compiled(None, str(exc))
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            log.info("grammar refused (%s, %d chars): %s", kind, len(spec), matcher.get_error())
            return Compiled(None, matcher.get_error())
        self.num_compiled += 1
        log.debug("grammar compiled (%s, %d chars) in %.2f ms", kind, len(spec), (time.perf_counter() - start) * 1e3)
        return Compiled(matcher)

    def matcher(self, compiled: Compiled) -> Matcher:
        """A fresh matcher at the start of the grammar (a copy of the compiled one)."""
        return Matcher(compiled, self.eos_token_ids)

    def fill_bitmask(self, matchers: list[Matcher]) -> tuple[np.ndarray, list[int]]:
        """The next-token bitmasks of these matchers ([R, ceil(V / 32)] int32, bit t of row i set when token t
        is allowed after matchers[i]; a buffer the next call reuses), computed by llguidance's thread pool
        without the GIL; and the rows that allow no token at all (a dead end), whose bits are all set instead."""
        rows = len(matchers)
        if self._bitmask.shape[0] < rows:
            self._bitmask = np.empty((max(rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]), np.int32)
        bitmask = self._bitmask[:rows]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m.handle, i) for i, m in enumerate(matchers)], bitmask)
        dead = np.flatnonzero(~bitmask.any(axis=1))
        if dead.size:
            bitmask[dead] = -1
        return bitmask, dead.tolist()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
