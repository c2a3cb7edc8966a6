"""N-gram prompt lookup: draft tokens for speculative decoding without a second model.

A request's next tokens often repeat text it has seen: a summary quotes its document, a code edit copies the
unchanged lines, a JSON rewrite keeps the keys. The proposer finds the latest earlier place where the request's
last n tokens (n from `max_n` down to `min_n`) occurred in its prompt and output, and proposes the tokens that
followed there. The engine runs them through the model in one forward with the request's last token and keeps
the longest prefix the model agrees with (engine.py), so a wrong draft costs a few rows of one step, never a token.

Each request proposes only while drafting pays: after a step whose drafts were all rejected it waits a number of
steps before it tries again, twice as many after each such step in a row (up to `MAX_COOLDOWN_STEPS`), and at
once again after a draft is accepted. On text with nothing to copy a request soon proposes rarely, and then only
when an n-gram matches.

How many of the proposed tokens go into a step is the engine's choice (`continuation` is what it weighs): each
request keeps a recent estimate of the chance that a draft is kept given that the drafts before it were, the
rate of a geometric law fitted to its last verify steps (a step that kept k of n drafts saw k continuations,
and one stop if k < n). Copying runs long once it starts, and an estimate that follows it lets a request in
a copy take long drafts while one whose drafts stop early takes short ones. Pure: lists of ints in, lists of
ints out.
"""

from __future__ import annotations

import heapq
from array import array

MAX_COOLDOWN_STEPS = 64
"""The longest a request waits, after drafts that were all rejected, before it proposes again."""
CONTINUATION_MEMORY = 0.7
"""Weight of a request's earlier verify steps at each new one in its continuation estimate (about the last
three steps count)."""
PRIOR_KEPT, PRIOR_STOPPED = 1.0, 1.0
"""The estimate before any verify step: one continuation and one stop, a chance of one half."""


class NgramDrafts:
    """One request's token history and how long it waits before it proposes again (the engine counts the
    drafts verified and kept, for every request together)."""

    __slots__ = ("tokens", "_bytes", "_cooldown", "_wait", "_kept", "_stopped")

    def __init__(self, token_ids: list[int]) -> None:
        self.tokens = array("i", token_ids)
        self._bytes: bytes | None = None
        self._cooldown = 0
        """Steps to wait after the next step whose drafts are all rejected."""
        self._wait = 0
        """Steps left before this request proposes again."""
        self._kept = 0.0
        self._stopped = 0.0
        """Decayed counts of drafts kept after a kept one (or first) and of drafts refused, over verify steps."""

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

    def continuation(self) -> float:
        """The chance that a draft is kept when the drafts before it in its step were, as recently seen."""
        kept = self._kept + PRIOR_KEPT
        return kept / (kept + self._stopped + PRIOR_STOPPED)

    def verified(self, num_accepted: int, num_proposed: int) -> None:
        """The model kept `num_accepted` of the `num_proposed` drafts of the last step: none makes the next wait
        longer."""
        self._kept = CONTINUATION_MEMORY * self._kept + num_accepted
        self._stopped = CONTINUATION_MEMORY * self._stopped + (num_accepted < num_proposed)
        if num_accepted:
            self._cooldown = 0
            return
        self._cooldown = min(MAX_COOLDOWN_STEPS, max(1, 2 * self._cooldown))
        self._wait = self._cooldown


def size_drafts(proposed: list[list[int]], continuations: list[float], num_rows: int, num_tokens: float,
                base_s: float, per_row_s: float) -> list[int]:
    """How many of each request's proposed drafts the next step verifies. A request's k-th draft is kept with
    about its continuation to the k-th power; drafts go in by that chance, highest first, each while it raises
    the step's expected tokens per second under the step-time model (time = base + per_row x rows): a row
    that is kept with chance p pays when p / per_row > tokens / time. `num_rows` and `num_tokens`: the step's
    rows and expected tokens without drafts. Without a model yet (per_row 0) every draft goes in."""
    if per_row_s <= 0.0:
        return [len(drafts) for drafts in proposed]
    counts = [0] * len(proposed)
    heap = [(-q, i) for i, (drafts, q) in enumerate(zip(proposed, continuations)) if drafts]
    heapq.heapify(heap)
    while heap:
        neg_p, i = heapq.heappop(heap)
        p = -neg_p
        if p * (base_s + per_row_s * num_rows) <= per_row_s * num_tokens:
            break  # every draft left has a chance at most p
        counts[i] += 1
        num_rows += 1
        num_tokens += p
        if counts[i] < len(proposed[i]):
            heapq.heappush(heap, (-p * continuations[i], i))
    return counts
