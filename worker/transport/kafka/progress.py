"""Which offsets above a committed offset are already answered: the out-of-order progress that travels in the
commit's metadata string.

Kafka's committed offset says where a partition's next owner starts reading. Under continuous batching requests
finish out of order, so the offset (the watermark, offsets.py) cannot pass a request still running while
requests above it already have their finals. With exactly-once finals those finals are committed in a
transaction; if the offset alone went with them, the next owner would start from the watermark and answer them
a second time. So the transaction also commits, in the offset's metadata (a string every OffsetCommit and
TxnOffsetCommit carries per partition, bounded by the broker's `offset.metadata.max.bytes`, 4096 by default),
the set of offsets above the watermark whose answers are in the log. The next owner reads it with the offset
and skips those records.

The text: `llmw1@<offset>:<runs>`. `<offset>` is the committed offset it belongs to (metadata found beside a
different offset, e.g. after an operator reset the group's offsets, is ignored). `<runs>` is a comma-separated
list of `<gap>.<length>` pairs in base 36: starting just above the offset, skip `gap` offsets not answered, then
`length` offsets answered, and on from there. An empty list: nothing above the offset is answered.

An optional `;r<offset>` (base 36) follows: where the partition's latest full round of progress records begins
on the progress topic (schemas/progress.py), so that the next owner resumes the streams of the requests still
running instead of starting them over. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable

PREFIX = "llmw1@"
DEFAULT_MAX_BYTES = 4096
"""The broker's `offset.metadata.max.bytes` default; a commit with longer metadata is refused whole."""
MAX_ANSWERED = 1_000_000
"""More answered offsets than this in one metadata string is not something a worker writes: ignored."""
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"

Runs = list[tuple[int, int]]
"""Answered offsets as (first, last) inclusive, ascending, disjoint and not touching."""


def _b36(n: int) -> str:
    if n == 0:
        return "0"
    out = []
    while n:
        n, digit = divmod(n, 36)
        out.append(_DIGITS[digit])
    return "".join(reversed(out))


def runs_of(offsets: Iterable[int]) -> Runs:
    """Sorted offsets as inclusive runs."""
    runs: Runs = []
    for offset in sorted(set(offsets)):
        if runs and offset == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], offset)
        else:
            runs.append((offset, offset))
    return runs


def encode(committed: int, runs: Runs, resume_from: int | None = None) -> str:
    """The metadata for `committed` with these answered runs, all above it, and where the progress records to
    resume from begin."""
    parts = []
    cursor = committed + 1
    for first, last in runs:
        if first < cursor or last < first:
            raise ValueError(f"runs must be ascending, disjoint and above {committed}: {runs}")
        parts.append(f"{_b36(first - cursor)}.{_b36(last - first + 1)}")
        cursor = last + 1
    resume = "" if resume_from is None else f";r{_b36(resume_from)}"
    return f"{PREFIX}{committed}:{','.join(parts)}{resume}"


def encoded_size(committed: int, runs: Runs, resume_from: int | None = None) -> int:
    """len(encode(committed, runs, resume_from).encode()) without building the string (all ASCII)."""
    size = len(PREFIX) + len(str(committed)) + 1 + max(len(runs) - 1, 0)
    if resume_from is not None:
        size += 2 + len(_b36(resume_from))
    cursor = committed + 1
    for first, last in runs:
        size += len(_b36(first - cursor)) + 1 + len(_b36(last - first + 1))
        cursor = last + 1
    return size


def decode(committed: int | None, metadata: str | None) -> Runs:
    """The answered runs recorded beside `committed`; [] for metadata that is not ours, belongs to another
    offset, or does not parse (it is then as if nothing above the offset were answered: at-least-once)."""
    if committed is None or not metadata or not metadata.startswith(PREFIX):
        return []
    head, sep, body = metadata[len(PREFIX):].partition(":")
    if not sep or head != str(committed):
        return []
    body = body.partition(";")[0]
    runs: Runs = []
    cursor = committed + 1
    try:
        for part in body.split(",") if body else []:
            gap, length = part.split(".")
            first = cursor + int(gap, 36)
            last = first + int(length, 36) - 1
            if last < first or int(gap, 36) < 0:
                return []
            runs.append((first, last))
            cursor = last + 1
    except ValueError:
        return []
    if sum(last - first + 1 for first, last in runs) > MAX_ANSWERED:
        return []
    return runs


def offsets_of(runs: Runs) -> set[int]:
    return {offset for first, last in runs for offset in range(first, last + 1)}


def resume_pointer(committed: int | None, metadata: str | None) -> int | None:
    """Where the progress records to resume from begin, recorded beside `committed`; None when there is none
    (or the metadata is not ours, or belongs to another offset)."""
    if committed is None or not metadata or not metadata.startswith(PREFIX):
        return None
    head, sep, body = metadata[len(PREFIX):].partition(":")
    if not sep or head != str(committed):
        return None
    for part in body.split(";")[1:]:
        if part.startswith("r"):
            try:
                return int(part[1:], 36)
            except ValueError:
                return None
    return None
