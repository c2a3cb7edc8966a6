"""Tool calls out of a completion's text as it streams: `ToolCallParser.feed` takes each text delta and gives
the content delta (the text outside calls) and the call pieces it completes (OpenAI's delta.tool_calls);
`finish` ends the text. What the pieces and content deltas add up to is exactly what `calls` and `content`
hold at the end, so a streamed answer and the final agree.

A call is `<tool_call>` + a JSON object {"name", "arguments"} + `</tool_call>` (render.py). When the object
begins `{"name": "<a known function>", "arguments": ` its first piece goes out at once and the arguments text
follows fragment by fragment, as the model writes it; a call's arguments end where their JSON value closes.
Otherwise the block is read whole at its closing tag. A block that names no offered function, or is not
JSON, stays in the content, tags and all. Text that may be the start of `<tool_call>` is held back until it is
known not to be. Content is trimmed: leading and trailing whitespace never goes out, so the calls' newlines
do not leave a content of blanks.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from worker.tools.render import CLOSE, OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class CallPiece:
    """One entry of delta.tool_calls: the first of a call has id and name, the rest argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class _Block:
    """A `<tool_call>` block being read."""

    text: str = ""
    call: ParsedCall | None = None
    """Set once its head was read (streaming mode)."""
    scanned: int = 0
    """Characters of `text` the arguments scanner has read."""
    started: bool = False
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    done: bool = False
    """Its arguments' JSON value is complete; what follows up to the closing tag is ignored."""


@dataclass(slots=True)
class ToolCallParser:
    names: frozenset[str]
    """The functions offered: a block naming another is content."""
    parallel: bool = True
    """False: only the first call is kept (later blocks are dropped)."""
    calls: list[ParsedCall] = field(default_factory=list)
    _held: str = ""
    """Text outside a block not yet given out: a possible beginning of OPEN."""
    _block: _Block | None = None
    _content: list[str] = field(default_factory=list)
    _seen_content: bool = False
    _blanks: str = ""
    """Whitespace at the end of the content so far, given out only if more content follows."""
    _dropping: bool = False
    """Inside a block past the first call when parallel is false."""

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The content delta and the call pieces that `text` (the next part of the output) completes."""
        content: list[str] = []
        pieces: list[CallPiece] = []
        rest = self._held + text
        self._held = ""
        while rest:
            if self._block is None:
                at = rest.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(rest, OPEN)
                    self._say(rest[:len(rest) - keep], content)
                    self._held = rest[len(rest) - keep:]
                    break
                self._say(rest[:at], content)
                rest = rest[at + len(OPEN):]
                self._block = _Block()
                self._dropping = not self.parallel and bool(self.calls)
                continue
            rest = self._read_block(rest, content, pieces)
        return "".join(content), pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        """The last content delta and call pieces, at the end of the output (a block left open ends there)."""
        content: list[str] = []
        pieces: list[CallPiece] = []
        if self._block is not None:
            block, self._block = self._block, None
            if not self._dropping and block.call is None and not self._close_whole(block, pieces):
                self._say(OPEN + block.text, content)
        elif self._held:
            self._say(self._held, content)
        self._held = ""
        return "".join(content), pieces

    # -- inside a block ------------------------------------------------------------------------------------

    def _read_block(self, rest: str, content: list[str], pieces: list[CallPiece]) -> str:
        """Take what `rest` holds of the open block; returns the text after the block's closing tag ('' while it
        is still open)."""
        block = self._block
        assert block is not None
        start = len(block.text)
        block.text += rest
        if self._dropping:
            return self._after_close(block, start, content, pieces)
        if block.call is None and not block.done:
            head = _HEAD.match(block.text)
            if head is not None:
                try:
                    name = json.loads(f'"{head.group(1)}"')
                except ValueError:
                    name = None
                if name in self.names:
                    block.call = ParsedCall(new_call_id(), name, "")
                    index = len(self.calls)
                    self.calls.append(block.call)
                    pieces.append(CallPiece(index, block.call.id, name, ""))
                    block.scanned = head.end()
                else:
                    block.done = True  # read whole at the closing tag, where it is refused
        if block.call is not None and not block.done:
            fragment = self._scan_arguments(block)
            if fragment:
                block.call.arguments += fragment
                pieces.append(CallPiece(len(self.calls) - 1, arguments=fragment))
            if not block.done:
                return ""
            return self._after_close(block, block.scanned, content, pieces, lookback=False)
        return self._after_close(block, start, content, pieces)

    def _after_close(self, block: _Block, start: int, content: list[str], pieces: list[CallPiece],
                     lookback: bool = True) -> str:
        """Look for the closing tag from `start` (a tag's length back with `lookback`, as the tag may straddle
        deltas; not where the arguments just closed, so a tag inside their strings is not taken for it)."""
        lo = max(0, start - len(CLOSE)) if lookback else start
        at = block.text.find(CLOSE, max(lo, block.scanned) if block.call is not None else lo)
        if at < 0:
            return ""
        after = block.text[at + len(CLOSE):]
        block.text = block.text[:at]
        self._block = None
        if not self._dropping and block.call is None and not self._close_whole(block, pieces):
            self._say(f"{OPEN}{block.text}{CLOSE}", content)
        return after

    def _scan_arguments(self, block: _Block) -> str:
        """The arguments text read since the last scan; sets block.done where their JSON value closes."""
        text, i, begin = block.text, block.scanned, block.scanned
        if not block.started:
            while i < len(text) and text[i].isspace():
                i += 1
            begin = i
            if i == len(text):
                block.scanned = i
                return ""
            if text[i] not in "{[":
                # Not an object: the block is read whole at its closing tag, where a string or number
                # argument is kept as the model wrote it.
                block.done, block.scanned = True, i
                return ""
            block.started = True
        while i < len(text):
            ch = text[i]
            i += 1
            if block.in_string:
                if block.escape:
                    block.escape = False
                elif ch == "\\":
                    block.escape = True
                elif ch == '"':
                    block.in_string = False
            elif ch == '"':
                block.in_string = True
            elif ch in "{[":
                block.depth += 1
            elif ch in "}]":
                block.depth -= 1
                if block.depth == 0:
                    block.done = True
                    break
        block.scanned = i
        return text[begin:i]

    def _close_whole(self, block: _Block, pieces: list[CallPiece]) -> bool:
        """Read a block that did not stream as one JSON object; False when it is not a call of an offered
        function."""
        try:
            value = json.loads(block.text)
        except ValueError:
            return False
        if not isinstance(value, dict) or value.get("name") not in self.names or "arguments" not in value:
            return False
        arguments = value["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = ParsedCall(new_call_id(), value["name"], text)
        self.calls.append(call)
        index = len(self.calls) - 1
        pieces += [CallPiece(index, call.id, call.name, ""), CallPiece(index, arguments=text)]
        return True

    # -- content ---------------------------------------------------------------------------------------------

    def _say(self, text: str, content: list[str]) -> None:
        if not self._seen_content:
            text = text.lstrip()
            if not text:
                return
            self._seen_content = True
        body = text.rstrip()
        if not body:
            self._blanks += text
            return
        out = self._blanks + body
        self._blanks = text[len(body):]
        content.append(out)
        self._content.append(out)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
