"""N-gram prompt lookup: draft tokens for speculative decoding without a second model.

A request's next tokens often repeat text it has seen: a summary quotes its document, a code edit copies the
unchanged lines, a JSON rewrite keeps the keys. The proposer finds the latest earlier place where the request's
last n tokens (n from `max_n` down to `min_n`) occurred in its prompt and output, and proposes the tokens that
followed there. The engine runs them through the model in one forward with the request's last token and keeps
the longest prefix the model agrees with (engine.py), so a wrong draft costs a few rows of one step, never a token.

Each request proposes only while drafting pays: after a step whose drafts were all rejected it waits a number of
steps before it tries again, twice as many after each such step in a row (up to `MAX_COOLDOWN_STEPS`), and at
once again after a draft is accepted. On text with nothing to copy a request soon proposes rarely, and then only
when an n-gram matches. Pure: lists of ints in, lists of ints out.
"""

from __future__ import annotations

from array import array

MAX_COOLDOWN_STEPS = 64
"""The longest a request waits, after drafts that were all rejected, before it proposes again."""


class NgramDrafts:
    """One request's token history and how long it waits before it proposes again (the engine counts the
    drafts verified and kept, for every request together)."""

    __slots__ = ("tokens", "_bytes", "_cooldown", "_wait")

    def __init__(self, token_ids: list[int]) -> None:
        self.tokens = array("i", token_ids)
        self._bytes: bytes | None = None
        self._cooldown = 0
        """Steps to wait after the next step whose drafts are all rejected."""
        self._wait = 0
        """Steps left before this request proposes again."""

    def extend(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self._bytes = None

    def truncate(self, num_tokens: int) -> None:
        """Forget tokens past the first `num_tokens` (a stop string ended the request earlier in a step)."""
        del self.tokens[num_tokens:]
        self._bytes = None

    def propose(self, num_draft: int, min_n: int, max_n: int) -> list[int]:
        """Up to `num_draft` tokens that followed the latest earlier occurrence of the longest suffix of the
        history (between min_n and max_n tokens) that occurred before; [] when none did or while cooling down."""
        if num_draft <= 0:
            return []
        if self._wait > 0:
            self._wait -= 1
            return []
        tokens = self.tokens
        length = len(tokens)
        if self._bytes is None:
            self._bytes = tokens.tobytes()
        haystack = self._bytes
        size = tokens.itemsize
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            needle = haystack[(length - n) * size:]
            # The latest occurrence that ends before the suffix itself (it may overlap it: a repeating pattern).
            end = (length - 1) * size
            while True:
                found = haystack.rfind(needle, 0, end)
                if found < 0:
                    break
                if found % size == 0:  # aligned on a token, not a byte pattern straddling two
                    start = found // size + n
                    return tokens[start:start + num_draft].tolist()
                end = found + len(needle) - 1
        return []

    def verified(self, num_accepted: int) -> None:
        """The model kept `num_accepted` of the drafts of the last step: none makes the next wait longer."""
        if num_accepted:
            self._cooldown = 0
            return
        self._cooldown = min(MAX_COOLDOWN_STEPS, max(1, 2 * self._cooldown))
        self._wait = self._cooldown
