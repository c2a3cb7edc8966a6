"""What compiling one grammar needs, shared by the compiler (grammar.py) and its judge processes (judge.py):
the limits a grammar may cost and how a refusal names them, the compiled result, the library's grammar for a
response_format, the check made before the first step, and the lowered priority that compile threads run at.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

COMPILE_NICE = 10
"""Nice value of the compile threads (CFS gives a thread at 10 about a tenth of a core beside a busy one at 0)."""

WALL_FACTOR = 10
"""A compile (first pass or judge) starved of CPU is refused when this many compile budgets of wall time
have passed: the budget itself counts CPU seconds, so a compile on a busy machine is not refused for the
machine's load until then."""

QUICK_LEXER_FUEL = 20_000
"""The first pass's lexer fuel (at most ENGINE_GRAMMAR_LEXER_FUEL): `a{1000000}` is refused at it in about
5 ms, against a second at the default fuel (the cost grows faster than the fuel: 25 ms at 100,000). Ordinary
schemas fit in it (100 properties, 10 x 10 nested objects, a 200-value enum, format and pattern strings: 0.2
to 4 ms each); a 5,000-value enum does not, and is judged."""

QUICK_STEP_MAX_ITEMS = 1_000
"""The first pass's parser items per step (at most ENGINE_GRAMMAR_STEP_MAX_ITEMS): a required recursive $ref
is refused at it in about 2 ms, against 0.1 s at the default."""

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options: one-line JSON (module docstring)."""

@dataclass(slots=True, frozen=True)
class GrammarLimits:
    """What one grammar may cost (llguidance's `LLParserLimits`, plus a time budget). The names are the engine
    settings' (ENGINE_GRAMMAR_*), so a refusal can name the one it broke."""

    max_size: int = 500_000
    lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    compile_timeout_s: float = 2.0

    def parser_limits(self) -> llguidance.LLParserLimits:
        # verbose_errors off: the message goes back to the producer, and the verbose one dumps parser state.
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_size, initial_lexer_fuel=self.lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items, max_lexer_states=self.max_lexer_states, verbose_errors=False)

    def explain(self, message: str) -> str:
        """The library's message without its state dump, naming the worker setting behind a limit it reports."""
        message = message.replace("<non-verbose/>", "").strip()
        if message.startswith("NoExtension"):  # llguidance's stop reason when only EOS fits an incomplete output
            return "no output can complete the format from here (its language is empty past this point)"
        setting = self.limit_named(message)
        if setting is not None:
            return f"{message} (worker limit ENGINE_GRAMMAR_{setting.upper()}={getattr(self, setting)})"
        return message

    @staticmethod
    def limit_named(message: str) -> str | None:
        """The field of the limit the library's message reports reaching, or None."""
        for needle, setting in _LIMIT_NEEDLES:
            if needle in message:
                return setting
        return None

    def quick(self) -> GrammarLimits:
        """The first pass's limits: the build limits cut to QUICK_LEXER_FUEL and QUICK_STEP_MAX_ITEMS."""
        return GrammarLimits(self.max_size, min(self.lexer_fuel, QUICK_LEXER_FUEL), self.step_lexer_fuel,
                             min(self.step_max_items, QUICK_STEP_MAX_ITEMS), self.max_lexer_states,
                             self.compile_timeout_s)

_LIMIT_NEEDLES = (
    ("grammar size", "max_size"),
    ("initial lexer configuration", "lexer_fuel"),
    ("too many expressions constructed", "lexer_fuel"),
    ("fuel exhausted", "step_lexer_fuel"),
    ("lex fuel", "step_lexer_fuel"),
    ("Too many items", "step_max_items"),
    ("too many states", "max_lexer_states"),
)
"""The library's wording for each limit it reports (from its binary), and the GrammarLimits field behind it."""

class GrammarError(RuntimeError):
    """A matcher reached an error state while generating: a limit hit only on the path the model took, or a
    token the grammar refused. The message is the library's (GrammarLimits.explain)."""

@dataclass(slots=True, frozen=True)
class Compiled:
    """A compiled grammar: a pristine matcher to copy for each request, or the library's error message."""

    matcher: llguidance.LLMatcher | None
    error: str | None = None
    retry_at: float | None = None
    """For a refusal that says nothing of the grammar (its compile was starved of CPU, or waited too long for
    a judge): time.monotonic() after which the same spec is compiled again instead of refused from the cache."""

EMPTY_LANGUAGE = "no output satisfies the format (its language is empty)"

def library_grammar(kind: str, spec: str) -> str | Compiled:
    """The library's grammar for a response_format, or its refusal."""
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(spec)
    except ValueError as exc:  # a schema that is not a JSON object, or nested past the parser's recursion
        return Compiled(None, str(exc))
    return Compiled(None, f"unknown grammar kind {kind!r}")

def first_step_error(matcher: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """What the library can tell before the first step (module docstring): None when the grammar may run, else
    the library's message (not yet explained) or EMPTY_LANGUAGE."""
    if matcher.is_error():
        return matcher.get_error()
    bitmask = np.empty((1, bitmask_width(vocab_size)), np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
    if matcher.is_error() or not bitmask.any():
        error = matcher.get_error()
        if not error or error.startswith("NoExtension"):
            return EMPTY_LANGUAGE
        return error
    forced = matcher.compute_ff_tokens()
    if forced:
        ahead = matcher.deep_copy()
        if not ahead.consume_tokens(forced) or ahead.is_error():
            return ahead.get_error() or "the grammar refused the tokens every output must begin with"
    return None

def compile_timeout_message(limits: GrammarLimits, seconds: float, what: str = "") -> str:
    return (f"compiling the grammar took {seconds:.2f} s{what}, over the budget of {limits.compile_timeout_s:g} s "
            f"(worker limit ENGINE_GRAMMAR_COMPILE_TIMEOUT_S={limits.compile_timeout_s:g})")

def starved_message(limits: GrammarLimits, wall: float, cpu: float | None, where: str = "",
                    factor: int | None = None) -> str:
    """A compile refused for the machine's load, not for the grammar: it says which limit, and that the same
    format may be sent again (Compiled.retry_at)."""
    had = "" if cpu is None else f", having had {cpu:.2f} s of CPU"
    return (f"compiling the grammar{where} did not finish within {wall:.1f} s of wall time{had} (worker limit "
            f"{factor or WALL_FACTOR} x ENGINE_GRAMMAR_COMPILE_TIMEOUT_S={limits.compile_timeout_s:g} s): the worker's "
            f"cores were busy with other work, which says nothing of the grammar; it may be sent again later")

def lower_priority(idle: bool = False) -> None:
    """Compile threads run niced (Linux nice is per thread), or at SCHED_IDLE (`idle`): a pathological
    grammar's compile then takes the cores from the forward pass only when they would idle, and a compile
    starved that way meets the wall-time bound. The mask threads (llguidance's executor, started by the
    engine's thread) keep their priority."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, COMPILE_NICE)
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass

def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
