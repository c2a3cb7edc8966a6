"""The id of a request record that failed to decode, read without decoding the record.

msgspec reads a record whole or not at all, so one flaw anywhere (a lone surrogate escape, nesting deeper than
Python's recursion limit, bytes cut off) hides an id that came before it; without the id the worker cannot send
the producer an `error` final record, and the producer waits forever. `first_top_level_id` reads the top-level
object's members in order and stops at the first "id" key, so whatever follows that member, broken or not, is
never read.

It never recurses and cannot be made slow. Escaped backslashes and quotes are first overwritten (keeping every
offset), which leaves each `"` a string's start or end: a string is then skipped by one C search whatever its
escapes, and an array or object by counting brackets outside strings (nesting is a number, not a stack), a
whole run of openers, strings and scalars up to a closing bracket at a time. The work is capped in steps (one
top-level member, one such run, or 8 strings or groups of brackets inside runs), so a record whose structure
before its id needs more gets no id: `[[[[...]]]]` costs a step per 16 KiB, `{"a":{"a":...}}` 10,000 deep
about 2,500 steps, a real request at most a few hundred.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

MAX_SCAN_STEPS = 4096
"""At most about 20 ms on a slow, busy core, however the bytes are arranged. A real request's id costs a few
steps, or a few hundred after 256 chat messages, or 32,768 prompt token ids."""

_FIRST_KEY = re.compile(rb'[ \t\n\r]*\{[ \t\n\r]*("[^"]*")[ \t\n\r]*:[ \t\n\r]*')
_NEXT_KEY = re.compile(rb'[ \t\n\r]*,[ \t\n\r]*("[^"]*")[ \t\n\r]*:[ \t\n\r]*')
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_NO_BRACKETS = rb'[^"\[\]{}]*'  # nor quotes
_FLAT = rb'[\[{]' + _NO_BRACKETS + rb'(?:"[^"]*"' + _NO_BRACKETS + rb')*[\]}]'
# Inside an array or object, up to a closing bracket that ends a nested one: strings are taken whole (a bracket
# in one does not count), and so are arrays and objects without nested ones, such as chat messages; a run of
# openers is taken at once, but for its last, which may start such an array or object.
_UP_TO_A_CLOSER = re.compile(
    _NO_BRACKETS + rb'(?:(?:' + _FLAT + rb'|"[^"]*"|[\[{]+(?=[\[{])|[\[{])' + _NO_BRACKETS + rb')*'
)
_CLOSERS = re.compile(rb"[\]}]+")
_WINDOW = 16 * 1024
"""Bytes one match may read, so that its cost, charged after it, stays small."""
_TOKENS_PER_STEP = 8
"""Strings and bracket groups one step pays for: the regex engine passes each in about 0.5 us, a step's own
Python in about 4 us."""
_BRACKETS_TO_OPENERS = bytes(ord("[") if c in b"[]{}" else ord("a") for c in range(256))
_ID_KEY = re.compile(rb'"(?:i|\\u0069)(?:d|\\u0064)"')  # the keys msgspec reads as "id"


def first_top_level_id(data: bytes, max_steps: int = MAX_SCAN_STEPS) -> str | None:
    """The string value of the first "id" member of the JSON object `data` starts with, read up to where the
    JSON breaks; None when there is no such member before the break, its value is not a valid JSON string
    (a lone surrogate escape is not), or finding it takes more than max_steps steps.

    A later duplicate "id" is not looked for (msgspec, reading a whole record, keeps the last): what comes
    after the first one may be the very part that broke."""
    # `\\` before `\"`: taking backslash pairs first, left to right, is how a JSON reader pairs them.
    text = data.replace(b"\\\\", b"__").replace(b'\\"', b"__") if b"\\" in data else data
    scan = _Scan(text, steps_left=max_steps)
    key = _FIRST_KEY.match(text)
    while key is not None and scan.spend(1):
        scan.pos = key.end()
        if _ID_KEY.fullmatch(key.group(1)):
            value = scan.string()
            return _decode_string(data[value[0] : value[1]]) if value is not None else None
        if not scan.skip_value():
            return None
        key = _NEXT_KEY.match(text, scan.pos)
    return None  # `}` (no id), the JSON breaks, or the steps ran out


@dataclass(slots=True)
class _Scan:
    text: bytes
    """The record with escaped backslashes and quotes overwritten: every `"` starts or ends a string."""
    steps_left: int
    pos: int = 0

    def spend(self, num_steps: int) -> bool:
        self.steps_left -= num_steps
        return self.steps_left >= 0

    def string(self) -> tuple[int, int] | None:
        """The start and end of the string at pos, quotes included; pos moves past it."""
        if self.text[self.pos : self.pos + 1] != b'"':
            return None
        end = self.text.find(b'"', self.pos + 1) + 1
        if end == 0:
            return None  # it never ends
        start, self.pos = self.pos, end
        return start, end

    def skip_value(self) -> bool:
        first = self.text[self.pos : self.pos + 1]
        if first == b'"':
            return self.string() is not None
        if first in (b"[", b"{"):
            return self._skip_container()
        scalar = _SCALAR.match(self.text, self.pos)
        if scalar is None:
            return False
        self.pos = scalar.end()
        return True

    def _skip_container(self) -> bool:
        # Brackets are counted, not matched by kind: what is skipped is passed over, not checked.
        self.pos += 1
        num_open = 1  # openers not yet closed
        while self.spend(1):
            num_open += self._pass_run()
            closers = _CLOSERS.match(self.text, self.pos)
            if closers is not None:
                num_closers = closers.end() - closers.start()
                if num_closers >= num_open:
                    self.pos += num_open
                    return True
                num_open -= num_closers
                self.pos = closers.end()
            elif self.pos == len(self.text):
                return False  # the record ends inside
            elif self.text[self.pos : self.pos + 1] == b'"' and self.string() is None:
                return False  # a string that never ends; one that only outran the window is now passed
        return False

    def _pass_run(self) -> int:
        """Pass what _UP_TO_A_CLOSER takes in one window, paying for its strings and groups of brackets;
        the number of openers in it left unclosed."""
        run = _UP_TO_A_CLOSER.match(self.text, self.pos, self.pos + _WINDOW).group()
        self.pos += len(run)
        pieces = run.split(b'"')  # outside, inside, outside, ...: the run holds whole strings
        outside = b"".join(pieces[0::2])
        num_bracket_groups = outside.translate(_BRACKETS_TO_OPENERS).count(b"a[")
        self.steps_left -= (len(pieces) // 2 + num_bracket_groups) // _TOKENS_PER_STEP
        return outside.count(b"[") + outside.count(b"{") - outside.count(b"]") - outside.count(b"}")


def _decode_string(token: bytes) -> str | None:
    # msgspec, as the real decoder would: it refuses lone surrogates, bad UTF-8 and raw control characters.
    try:
        return msgspec.json.decode(token, type=str)
    except msgspec.DecodeError:
        return None
