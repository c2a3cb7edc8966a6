"""One submitted request as the client sees it: the stream of its chunks and its final record.

The client's result consumer feeds every record with this request's id into `RequestHandle.feed`; the
caller reads `stream()` and/or `result()`. Records of one id share a Kafka partition (key = id), so they
arrive in the order the worker wrote them, and within one attempt `seq` runs 0, 1, 2, ... with no holes.

Attempts. A worker that dies mid-request leaves the request uncommitted; another worker serves it again
under a strictly higher `attempt` (the first attempt is not necessarily 0). The handle follows the highest
attempt seen: records of lower attempts are dropped from then on, chunks of the old attempt that were
buffered but not yet yielded are discarded, and the stream starts over at the new attempt's seq 0. A stream
reader learns of a restart from `Delta.restarted` (True on the first delta of a new attempt when deltas of
an older attempt were already yielded): it must throw away the text it showed for the old attempt.

Resumption. A worker that takes a request over may continue its stream where the old one stopped instead:
the new attempt's records carry `resumed_at` (per completion index), the seq from which it writes. The chunks
below it stand, whichever attempt sent them, and the stream goes on without a gap or a repeat; the reader
sees `Delta.resumed` on the first delta of the new attempt and keeps its text. Should the reader have been
given chunks at or past `resumed_at` by the old attempt (the new worker could not read them back), the next
delta carries `rewound_to`: throw away the text of those seqs.

Several completions (n > 1 or best_of > 1). Chunks carry `index` with a seq of their own per index; each
completion ends with a final that carries its index, and the request with a final without index (`result()`),
whose num_chunks counts every index's chunks. `completions()` gives the completions' finals by index.

Cancelling. `cancel()` writes a cancel record (through the client); the request then ends with a `cancelled`
final holding the text so far, which `result()` returns and which ends `stream()`. With cancel_on_abandon, a
task cancelled while waiting in `stream()` or `result()` sends the cancel itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from schemas.result import FinalRecord, StreamChunk

log = logging.getLogger(__name__)


class ClientError(RuntimeError):
    """Base of the client's own exceptions."""


class RequestTimeout(ClientError, asyncio.TimeoutError):
    """No final record arrived within the wait; the request may still be served later."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"request {request_id}: no final record within {timeout_s:.3g} s")
        self.request_id = request_id
        self.timeout_s = timeout_s


class StreamGap(ClientError):
    """A chunk of the current attempt is missing (seq jumped, or the final counts more chunks than came).

    The final record of a completed request still holds the whole text, so `result()` stays usable.
    """

    def __init__(self, request_id: str, attempt: int, expected_seq: int, got_seq: int) -> None:
        super().__init__(f"request {request_id} attempt {attempt}: expected chunk seq {expected_seq}, got {got_seq}")
        self.request_id, self.attempt, self.expected_seq, self.got_seq = request_id, attempt, expected_seq, got_seq


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for event up to timeout_s; True if it was set.

    Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as the event is set, and a
    Ctrl-C (which cancels the main task) would then be lost while chunks stream in.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return bool(done)


@dataclass(frozen=True, slots=True)
class Delta:
    """One stream chunk as yielded by `RequestHandle.stream()`."""

    chunk: StreamChunk
    restarted: bool = False
    """True on the first delta of a superseding attempt after older-attempt deltas were yielded."""
    resumed: bool = False
    """True on the first delta of an attempt that continues the stream of an older one (keep what was shown)."""
    rewound_to: int | None = None
    """Set when deltas at or past this seq (of this index) were yielded from an older attempt that a resumed one
    replaces: throw away their text."""

    @property
    def text(self) -> str:
        return self.chunk.text

    @property
    def token_ids(self) -> list[int]:
        return self.chunk.token_ids

    @property
    def attempt(self) -> int:
        return self.chunk.attempt

    @property
    def seq(self) -> int:
        return self.chunk.seq

    @property
    def index(self) -> int:
        """Which completion (0 unless the request asked for n > 1)."""
        return self.chunk.index


class RequestHandle:
    """Returned by `LLMClient.submit`; read it with `stream()` and `result()`."""

    def __init__(self, request_id: str, priority: int, partition: int, timeout_s: float,
                 on_close: Callable[[str], None], *,
                 send_cancel: Callable[[str, str], asyncio.Future] | None = None,
                 cancel_on_abandon: bool = False) -> None:
        """send_cancel(request_id, reason): starts sending a cancel record (LLMClient does it); cancel_on_abandon:
        send one when a task waiting in stream() or result() is cancelled before the final arrived."""
        self.request_id = request_id
        self.cancel_on_abandon = cancel_on_abandon
        self._send_cancel = send_cancel
        self._cancel_sent: asyncio.Future | None = None
        self.priority = priority
        self.partition = partition
        """Request-topic partition the request was written to."""
        self.timeout_s = timeout_s
        """Default wait of stream() and result(), counted from submit."""
        self.submitted_at = time.monotonic()
        self.sent_at: float | None = None
        """When Kafka acknowledged the request (after any backoff)."""
        self.first_chunk_at: float | None = None
        self.final_at: float | None = None
        self.backoff_s = 0.0
        """Time submit() waited because a worker reported shedding or paused partitions for this priority."""
        self.attempt: int | None = None
        """Highest attempt seen so far."""
        self.num_restarts = 0
        self.num_resumptions = 0
        """Times a higher attempt continued the stream instead of starting it over."""
        self._resuming: set[int] | None = None
        """While the current attempt is a resumption: the completion indexes it has not written to yet."""
        self._yielded_seq: dict[int, int] = {}
        """Next seq per index the reader has not been given yet."""
        self._rewind: dict[int, int] = {}
        """Index -> seq to rewind to, told with the next delta of that index."""
        self.num_dropped = 0
        """Records dropped as superseded (lower attempt) or duplicate."""
        self._expected_seq: dict[int, int] = {}
        """Next seq per completion index."""
        self._completions: dict[int, FinalRecord] = {}
        """Finals of single completions (n > 1), by index."""
        # A StreamGap sits in the queue where the missing chunks would have been, so the reader gets every
        # chunk before the hole and then the exception.
        self._pending: deque[StreamChunk | StreamGap] = deque()
        self._yielded_attempt: int | None = None
        self._gap_seen = False
        self._final: FinalRecord | None = None
        self._changed = asyncio.Event()
        self._on_close = on_close

    # -- fed by the client's consumer ------------------------------------------------------------------
    def feed(self, record: StreamChunk | FinalRecord) -> None:
        if self._final is not None:
            # One answer per handle: a later redelivery's records (its worker died after publishing the
            # final but before committing) repeat work already answered.
            self.num_dropped += 1
            return
        if self.attempt is not None and record.attempt < self.attempt:
            self.num_dropped += 1
            return
        if self.attempt is None or record.attempt > self.attempt:
            resumes = record.resumed_at is not None and self.attempt is not None
            if self.attempt is not None:
                log.info("request %s: attempt %d %s attempt %d", self.request_id, record.attempt,
                         "resumes the stream of" if resumes else "supersedes", self.attempt)
                if resumes:
                    self.num_resumptions += 1
                else:
                    self.num_restarts += 1
            self.attempt = record.attempt
            self._completions = {}
            self._gap_seen = False
            if resumes:
                self._resuming = set(self._expected_seq) | {record.index or 0}
            else:
                self._resuming = None
                self._expected_seq = {}
                self._pending.clear()
        if self._resuming is not None and record.resumed_at is not None and (record.index or 0) in self._resuming:
            self._take_over(record.index or 0, record.resumed_at)
        if isinstance(record, StreamChunk):
            self._feed_chunk(record)
        elif record.index is not None:
            expected = self._expected_seq.get(record.index, 0)
            if record.num_chunks != expected:
                self._add_gap(StreamGap(self.request_id, record.attempt, expected, record.num_chunks))
            self._completions[record.index] = record
        else:
            expected = sum(self._expected_seq.values())
            if record.num_chunks != expected:
                self._add_gap(StreamGap(self.request_id, record.attempt, expected, record.num_chunks))
            self._final = record
            self.final_at = time.monotonic()
        self._changed.set()

    def _take_over(self, index: int, resumed_at: int) -> None:
        """The current attempt writes completion `index` from seq `resumed_at` on: the older attempts' chunks
        below it stand, those at or past it give way."""
        self._resuming.discard(index)
        kept = [c for c in self._pending
                if isinstance(c, StreamGap) or c.index != index or c.seq < resumed_at]
        self._pending = deque(kept)
        if self._yielded_seq.get(index, 0) > resumed_at:
            self._rewind[index] = resumed_at
        expected = self._expected_seq.get(index, 0)
        if expected < resumed_at:
            self._add_gap(StreamGap(self.request_id, self.attempt, expected, resumed_at))
        self._expected_seq[index] = resumed_at

    def _feed_chunk(self, chunk: StreamChunk) -> None:
        expected = self._expected_seq.get(chunk.index, 0)
        if chunk.seq < expected:
            self.num_dropped += 1  # a duplicate; nothing new in it
            return
        if chunk.seq > expected:
            self._add_gap(StreamGap(self.request_id, chunk.attempt, expected, chunk.seq))
        self._expected_seq[chunk.index] = chunk.seq + 1
        if self.first_chunk_at is None:
            self.first_chunk_at = time.monotonic()
        self._pending.append(chunk)

    def _add_gap(self, gap: StreamGap) -> None:
        log.warning("%s", gap)
        if not self._gap_seen:  # the stream ends at the first hole; later ones add nothing for the reader
            self._gap_seen = True
            self._pending.append(gap)

    # -- read by the caller ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._final is not None

    def _remaining(self, timeout_s: float | None) -> tuple[float, float]:
        """(wait used, seconds left): an explicit timeout counts from now, the default from submit."""
        if timeout_s is not None:
            return timeout_s, timeout_s
        return self.timeout_s, self.timeout_s - (time.monotonic() - self.submitted_at)

    async def _wait_change(self, deadline: float, timeout_s: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout(self.request_id, timeout_s)
        self._changed.clear()
        try:
            changed = await wait_event(self._changed, left)
        except asyncio.CancelledError:
            # The caller gave up waiting (its task was cancelled; Ctrl-C under asyncio.run cancels the main task):
            # tell the workers to stop, rather than have them finish an answer nobody reads.
            if self.cancel_on_abandon and self._final is None and self._send_cancel is not None:
                self._start_cancel("")
            raise
        if not changed:
            raise RequestTimeout(self.request_id, timeout_s)

    def _start_cancel(self, reason: str) -> asyncio.Future:
        if self._cancel_sent is None:
            if self._send_cancel is None:
                raise ClientError("this handle has no client to send a cancel with")
            self._cancel_sent = self._send_cancel(self.request_id, reason)
        return self._cancel_sent

    async def cancel(self, reason: str = "") -> None:
        """Ask the workers to stop this request (a cancel record on the control topic); returns once Kafka has
        acknowledged it. The request then ends with a `cancelled` final carrying the text so far (read it with
        result() or stream()), unless it had finished already. Sent once however often it is called."""
        await asyncio.shield(self._start_cancel(reason))

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_sent is not None

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Delta]:
        """Yield the chunks of the current attempt in seq order until the final record arrives.

        Raises StreamGap on a missing chunk and RequestTimeout when the wait runs out. A request sent with
        stream=False yields nothing. Read it once: yielded chunks are not kept.
        """
        timeout_s, left = self._remaining(timeout)
        deadline = time.monotonic() + left
        while True:
            if self._pending:
                chunk = self._pending.popleft()
                if isinstance(chunk, StreamGap):
                    raise chunk
                new_attempt = self._yielded_attempt is not None and chunk.attempt != self._yielded_attempt
                resumed = new_attempt and chunk.resumed_at is not None
                self._yielded_attempt = chunk.attempt
                self._yielded_seq[chunk.index] = chunk.seq + 1
                yield Delta(chunk, new_attempt and not resumed, resumed, self._rewind.pop(chunk.index, None))
                continue
            if self._final is not None:
                return
            await self._wait_change(deadline, timeout_s)

    async def result(self, timeout: float | None = None) -> FinalRecord:
        """The final record of the highest attempt. Raises RequestTimeout when the wait runs out."""
        timeout_s, left = self._remaining(timeout)
        deadline = time.monotonic() + left
        while self._final is None:
            await self._wait_change(deadline, timeout_s)
        return self._final

    async def completions(self, timeout: float | None = None) -> list[FinalRecord]:
        """Every completion's final, by index, once the request ended: with n > 1 (or best_of > 1) the finals
        that carry an index; otherwise [the request's final]. Raises RequestTimeout when the wait runs out."""
        final = await self.result(timeout)
        if not self._completions:
            return [final]
        return [self._completions[i] for i in sorted(self._completions)]

    @property
    def ttft_s(self) -> float | None:
        """Client-side time to first token: from the Kafka acknowledgement of the request to its first chunk."""
        if self.first_chunk_at is None or self.sent_at is None:
            return None
        return self.first_chunk_at - self.sent_at

    @property
    def e2e_s(self) -> float | None:
        """Client-side end to end: from the acknowledgement of the request to its final record."""
        if self.final_at is None or self.sent_at is None:
            return None
        return self.final_at - self.sent_at

    def close(self) -> None:
        """Stop routing records to this handle (the client forgets it)."""
        self._on_close(self.request_id)
