"""Incremental detokenization with stop strings: token ids in, text deltas out.

Decoding token by token is wrong for byte-level BPE (one emoji spans several tokens, and a lone token
decodes to U+FFFD) and for tokenizers that drop a word's leading space at the start of a decode. So,
as in vLLM and TGI, each step decodes a short window: the tokens from `prefix_offset` on, and again only
those before `read_offset`; the difference is the new text. When the window's text ends in U+FFFD the
character is incomplete and nothing is emitted until a later token completes it.

Stop strings: output text that could still be the start of a stop string is held back until the next
tokens decide it, so no part of a stop string is ever emitted; on a match the text is cut before it and
`stopped` becomes True. The window starts inside the prompt so the first output token decodes in context.
"""

from __future__ import annotations

# How many prompt tokens give the first output token its context (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""
        """All output text decoded so far (a stop string cuts it)."""
        self._emitted = 0
        """Characters of _text already returned to the caller."""
        self._search_from = 0
        """No stop string starts before this index of _text (already checked)."""
        self.stopped = False
        self.stop_string: str | None = None
        """The stop string that matched, when stopped."""

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return self._text[: self._emitted]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        # Window moves on only when text came out, so a held-back partial character stays inside it.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def push(self, token_ids: list[int]) -> str:
        """Add newly sampled tokens; returns the text that may be shown now ("" once stopped)."""
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        self._text += self._decode_new(final=False)
        return self._advance(final=False)

    def flush(self) -> str:
        """At finish: emit what was held back (a partial character decodes as U+FFFD, as decode would)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._token_ids):
            self._text += self._decode_new(final=True)
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stop:
            match = self._find_stop()
            if match is not None:
                self._text = self._text[: match[0]]
                self.stop_string = match[1]
                self.stopped = True
                return self._emit(len(self._text))
            if not final:
                return self._emit(len(self._text) - self._stop_prefix_len())
        return self._emit(len(self._text))

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """(index, stop string) of the earliest match in _text, searching only text not checked before."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, max(0, self._search_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        self._search_from = len(self._text)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of _text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest
