"""Incremental detokenization with stop strings: token ids in, text deltas out.

Decoding token by token is wrong for byte-level BPE (one emoji spans several tokens, and a lone token
decodes to U+FFFD) and for tokenizers that drop a word's leading space at the start of a decode. So,
as in vLLM and TGI, each step decodes a short window: the tokens from `prefix_offset` on, and again only
those before `read_offset`; the difference is the new text. When the window's text ends in U+FFFD the
character is incomplete and nothing is emitted until a later token completes it.

Stop strings: output text that could still be the start of a stop string is held back until the next
tokens decide it, so no part of a stop string is ever emitted; on a match the text is cut before it and
`stopped` becomes True. The window starts inside the prompt so the first output token decodes in context.

Byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2, GPT-2) need no windows: their decoder maps each token to
fixed bytes and the text is those bytes' UTF-8 decoding, so a `ByteLevelTable` built once per tokenizer and an
incremental UTF-8 decoder give the same text for a fraction of a microsecond per token instead of two calls
into the tokenizer (about 3 µs per request and step through transformers' `decode`, the largest host cost of a
decode step at 256 running requests). Other tokenizers keep the window algorithm, calling the Rust tokenizer
directly when transformers' `decode` would not change its output.
"""

from __future__ import annotations

import codecs
import weakref

# How many prompt tokens give the first output token its context (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class ByteLevelTable:
    """The bytes each token id decodes to under a byte-level BPE decoder, skipped special tokens as b"".

    Mirrors the Rust `tokenizers` decode: ids map to tokens (added tokens to their content, unknown ids are
    dropped), special tokens are dropped when skipped, and the ByteLevel decoder maps each token's characters
    back through the GPT-2 byte alphabet (a token with a character outside it keeps its own UTF-8 bytes); the
    text is the UTF-8 decoding of all the bytes with invalid sequences replaced. `of` returns None for any
    tokenizer whose decode is not exactly that.
    """

    __slots__ = ("token_bytes", "token_text", "__weakref__")
    _cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.token_text: list[str | None] = [_whole_utf8(b) for b in token_bytes]
        """A token's text when its bytes are complete UTF-8 by themselves (most are), else None. Decoding
        such a token after a boundary (nothing pending) gives exactly that text."""

    def __len__(self) -> int:
        return len(self.token_bytes)

    def bytes_of(self, token_ids: list[int]) -> bytes:
        table = self.token_bytes
        try:
            if len(token_ids) == 1:
                return table[token_ids[0]]
            return b"".join([table[t] for t in token_ids])
        except IndexError:  # an id past the tokenizer's vocabulary decodes to nothing, as in `decode`
            return b"".join([table[t] if t < len(table) else b"" for t in token_ids])

    @classmethod
    def of(cls, tokenizer, skip_special_tokens: bool = True) -> "ByteLevelTable | None":
        try:
            per_tokenizer = cls._cache.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: build every time
            per_tokenizer = {}
        if skip_special_tokens not in per_tokenizer:
            per_tokenizer[skip_special_tokens] = cls._build(tokenizer, skip_special_tokens)
        return per_tokenizer[skip_special_tokens]

    @classmethod
    def _build(cls, tokenizer, skip_special_tokens: bool) -> "ByteLevelTable | None":
        from tokenizers import decoders

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
            return None
        if not _plain_backend_decode(tokenizer):
            return None
        char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        vocab = backend.get_vocab(with_added_tokens=True)
        token_bytes = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            try:
                token_bytes[token_id] = bytes([char_to_byte[c] for c in token])
            except KeyError:
                token_bytes[token_id] = token.encode()
        if skip_special_tokens:
            for token_id, added in backend.get_added_tokens_decoder().items():
                if added.special and token_id < len(token_bytes):
                    token_bytes[token_id] = b""
        return cls(token_bytes)


def _whole_utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, as the ByteLevel pre-tokenizer and decoder use it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _plain_backend_decode(tokenizer) -> bool:
    """Whether transformers' `decode` returns the Rust tokenizer's decode unchanged (no clean-up pass)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    # transformers skips the clean-up for BPE models unless told to corrupt their output anyway.
    return type(tokenizer.backend_tokenizer.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        byte_level: bool = True,
    ) -> None:
        """byte_level=False forces the window algorithm even for a byte-level tokenizer (tests compare both)."""
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self._table = ByteLevelTable.of(tokenizer, skip_special_tokens) if byte_level else None
        self._pending = b""
        """Bytes of an incomplete UTF-8 character (byte-level table): an incremental UTF-8 decoder's buffer,
        kept here so that a token whose bytes are whole characters skips the decoder."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None and _plain_backend_decode(tokenizer) else None
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""
        """All output text decoded so far (a stop string cuts it); with no stop strings and a byte-level table,
        the text goes to `_pieces` instead (appending to a growing string copies it at every step)."""
        self._pieces: list[str] = []
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
        if self._pieces:
            self._text, self._pieces = self._text + "".join(self._pieces), []
            self._emitted = len(self._text)
        return self._text[: self._emitted]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self.skip_special_tokens)
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
        if self._table is not None:
            text = None
            if len(token_ids) == 1 and not self._pending:  # one token, at a character boundary: the common case
                try:
                    text = self._table.token_text[token_ids[0]]
                except IndexError:
                    pass
            if text is None:
                text = self._decode_bytes(self._table.bytes_of(token_ids), final=False)
            if not self.stop:  # nothing is held back: the text is emitted as it comes
                if text:
                    self._pieces.append(text)
                return text
            self._text += text
            return self._advance(final=False)
        self._token_ids.extend(token_ids)
        self._text += self._decode_new(final=False)
        return self._advance(final=False)

    def flush(self) -> str:
        """At finish: emit what was held back (a partial character decodes as U+FFFD, as decode would)."""
        if self.stopped:
            return ""
        if self._table is not None:
            text = self._decode_bytes(b"", final=True)
            if not self.stop:
                if text:
                    self._pieces.append(text)
                return text
            self._text += text
        elif self._read_offset < len(self._token_ids):
            self._text += self._decode_new(final=True)
        return self._advance(final=True)

    def _decode_bytes(self, data: bytes, final: bool) -> str:
        """What codecs' incremental UTF-8 decoder ("replace") does with its buffer."""
        data = self._pending + data
        text, consumed = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[consumed:]
        return text

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
