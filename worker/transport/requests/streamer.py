"""From engine outputs to result records: chunks (one per engine step, or coalesced over chunk_interval_ms),
then exactly one final record per request and attempt, whose acknowledgement marks the request record's
offset done.

Holds one `RequestStream` per request in the engine, the one place that knows which engine request belongs to
which Kafka record. Closing a stream early (its partition moved to another worker, shutdown past the drain
timeout) silences it: later outputs for that engine id are dropped, so nothing more is published for a
partition this worker no longer owns. During a rebalance the revoked partitions' streams are held (`hold`):
their requests keep running, their tokens gather unsent and their final records wait, until the assignment
says whether each partition stays (`release`: everything gathered goes out, with no gap in the chunk
sequence) or moves (`close_where`: nothing of it is published; the new owner serves it under a higher
attempt). A request the engine replays from its first token (the engine failed on a step it was in, see
engine_thread.py) continues its stream without repeating what was sent; a poison request goes to Answers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from schemas.decode import encode
from schemas.progress import CompletionProgress, ProgressRecord
from schemas.result import FinalRecord, StreamChunk, TokenLogprob, TopLogprob
from schemas.tools import FunctionCall, ToolCall, ToolCallDelta
from worker.engine.api import RequestOutput
from worker.transport.requests.answers import Answers
from worker.transport.requests.local_queue import QueuedRequest, resumable
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.kafka.publisher import Publisher
from worker.transport.requests.records import final_for_output, group_final
from worker.transport.load.service_model import ServiceModel
from worker.transport.load.tenant_book import TenantBook
from worker.tools.parse import CallPiece, ToolCallParser

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class CompletionGroup:
    """The completions of one request with n > 1 or best_of > 1, each a stream of its own. Every completion's
    final record is built when it finishes: with best_of = n it goes out at once (index = its completion),
    with best_of > n the n of highest cumulative logprob go out ranked once all are done. Then one request-level
    final (no index), whose acknowledgement marks the request record's offset done."""

    queued: QueuedRequest
    finals: list[FinalRecord | None]
    """By completion index, once finished."""
    scores: list[float]
    """Cumulative logprob by completion index (ranks completions when best_of > n)."""
    num_chunks: int = 0
    members: list["RequestStream"] = field(default_factory=list)
    """Its completions' streams, finished ones too (their progress counts until the request's final)."""
    poisoned: bool = False
    """One completion made the engine fail: the request was answered with an error; the others are dropped."""

    @property
    def ranked(self) -> bool:
        return len(self.finals) > self.queued.request.n


@dataclass(slots=True)
class RequestStream:
    """A request in the engine: the tokens and text it generated so far, and what was already sent."""

    queued: QueuedRequest
    index: int = 0
    """Which completion of its request (0 unless n > 1 or best_of > 1)."""
    group: CompletionGroup | None = None
    seq: int = 0
    """The next chunk's sequence number (= chunks sent so far)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    """Aligned with token_ids when the request asked for logprobs (set by Streamer.open)."""
    text_parts: list[str] = field(default_factory=list)
    num_unsent_tokens: int = 0
    unsent_text: list[str] = field(default_factory=list)
    last_flush: float = field(default_factory=time.monotonic)
    num_replay_tokens: int = 0
    """After a replay marker: how many of the tokens that follow repeat ones already gathered (and sent)."""
    replay_diverged: bool = False
    cancel_reason: str | None = None
    """Set when its producer cancelled it (Streamer.cancel): the engine's abort then ends it `cancelled`."""
    tools: ToolCallParser | None = None
    """Parses tool calls out of the text when the request's tools may be called; fed what goes out in chunks,
    or the whole text at the end when none do."""
    tools_ended: bool = False
    """The parser was told the output ended (its held-back text given out), which happens once."""
    resumed_at: int | None = None
    """The seq at which this attempt took the stream over from an earlier one (schemas.result.ResumedAt)."""
    sent_text_len: int = 0
    """Characters of text the chunks taken so far carried."""
    acked: tuple[int, int, int, int] = (0, 0, 0, 0)
    """How much of the stream Kafka has acknowledged, as of its last acknowledged chunk: (chunks, tokens,
    characters of text, tool calls announced). Chunks of one request share a partition and are acknowledged in
    order."""
    settled: CompletionProgress | None = None
    """The progress record's view of `acked`, built when a round asks (cached while `acked` stays)."""
    recorded: bool = False
    """Its request has had a progress record written (set on the first completion's stream)."""
    progress_mark: tuple = ()
    progress_ts_ms: int = 0
    """The progress its last record showed and when that progress was first recorded (on the first completion's
    stream): a record of unchanged progress is byte for byte the one before, so an unchanged round is seen as
    such and not written again."""
    started: bool = False
    """The engine gave it its first token (or ended it before one): its tenant's charge is no longer pending."""

    @property
    def sends_chunks(self) -> bool:
        """Chunks go out when the request streams, except for best_of > n (which completions are returned is
        known only at the end)."""
        return self.queued.request.stream and (self.group is None or not self.group.ranked)

    @property
    def logprobs_asked(self) -> bool:
        """The client asked for logprobs (they may be gathered only to rank best_of completions)."""
        return self.queued.request.sampling.logprobs

    def resume_from(self, done: CompletionProgress) -> None:
        """Continue the stream an earlier attempt delivered this much of."""
        self.token_ids = list(done.token_ids)
        self.text_parts = [done.text] if done.text else []
        self.seq = done.seq
        self.sent_text_len = len(done.text)
        self.resumed_at = done.seq if self.sends_chunks else None
        self.acked = (done.seq, len(done.token_ids), len(done.text), len(done.tool_call_ids))
        self.settled = done
        if self.tools is not None and done.text:
            # Where the parser stood: what it said then went out already; the calls keep the ids announced.
            self.tools.feed(done.text)
            for call, call_id in zip(self.tools.calls, done.tool_call_ids):
                call.id = call_id

    def mark(self) -> tuple[int, int, int, int]:
        """The stream's `acked` once every chunk taken so far is acknowledged."""
        return (self.seq, len(self.token_ids) - self.num_unsent_tokens, self.sent_text_len,
                len(self.tools.calls) if self.tools is not None else 0)

    def note_acked(self, mark: tuple[int, int, int, int]) -> None:
        if mark[0] > self.acked[0]:
            self.acked = mark

    def progress(self) -> CompletionProgress:
        """What a client can see of this completion now: its acknowledged chunks; everything generated when it
        does not stream."""
        if not self.sends_chunks:
            return CompletionProgress(index=self.index, token_ids=list(self.token_ids), text="".join(self.text_parts))
        seq, num_tokens, num_chars, num_calls = self.acked
        if self.settled is None or self.settled.seq != seq:
            self.settled = CompletionProgress(
                index=self.index, seq=seq, token_ids=self.token_ids[:num_tokens],
                text="".join(self.text_parts)[:num_chars],
                tool_call_ids=[c.id for c in self.tools.calls[:num_calls]] if self.tools is not None else [])
        return self.settled

    def start_replay(self) -> None:
        self.num_replay_tokens = len(self.token_ids)

    def add(self, out: RequestOutput) -> None:
        if self.num_replay_tokens:
            self._add_replayed(out)
            return
        self.token_ids += out.new_token_ids
        self.num_unsent_tokens += len(out.new_token_ids)
        if self.logprobs is not None:
            self._add_logprobs(out, 0)
        if out.text_delta:
            self.text_parts.append(out.text_delta)
            self.unsent_text.append(out.text_delta)

    def _add_replayed(self, out: RequestOutput) -> None:
        """A replay regenerates from the first token; the client already has the first num_replay_tokens, so
        they are checked, not sent again. Greedy and seeded sampling give the same tokens whatever shares the
        batch, so a replay normally matches; if it does not, the request ends in an error (see handle)."""
        done = len(self.token_ids) - self.num_replay_tokens
        repeated = out.new_token_ids[:self.num_replay_tokens]
        if repeated != self.token_ids[done:done + len(repeated)]:
            self.replay_diverged = True
        self.num_replay_tokens -= len(repeated)
        rest = out.new_token_ids[len(repeated):]
        if rest:
            # Text deltas of a step cover its tokens; a step that crosses the end of the replay is a decode step
            # of one token in practice, so its whole delta is new text.
            self.token_ids += rest
            self.num_unsent_tokens += len(rest)
            if self.logprobs is not None:
                self._add_logprobs(out, len(repeated))
            if out.text_delta:
                self.text_parts.append(out.text_delta)
                self.unsent_text.append(out.text_delta)

    def _add_logprobs(self, out: RequestOutput, skip: int) -> None:
        if not out.new_token_ids:
            return
        if out.new_logprobs is None or len(out.new_logprobs) != len(out.new_token_ids):
            # An engine without logprobs (a model-free one): none are sent rather than misaligned ones.
            log.warning("request %s asked for logprobs; its engine gives none", out.request_id)
            self.logprobs = None
            return
        self.logprobs += [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=[
            TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)])
            for lp in out.new_logprobs[skip:]]

    def end_tools(self) -> tuple[str, list[CallPiece]]:
        """Ends the parser's input once (the output is complete)."""
        if self.tools is None or self.tools_ended:
            return "", []
        self.tools_ended = True
        return self.tools.finish()

    def parsed_tool_calls(self) -> tuple[str | None, list[ToolCall] | None]:
        """(content, tool_calls) for the final record: the whole text is parsed when no chunk was."""
        if self.tools is None:
            return None, None
        if not self.sends_chunks:
            self.tools.feed("".join(self.text_parts))
        self.end_tools()
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in self.tools.calls]
        return self.tools.content, calls or None

    def take_chunk(self, now: float, last: bool = False) -> StreamChunk | None:
        """The tokens since the last chunk as one StreamChunk; None when there is nothing new. `last`: the
        output has ended, so the tool-call parser gives out what it held back."""
        content, pieces = None, None
        if self.tools is not None:
            content, pieces = self.tools.feed("".join(self.unsent_text))
            if last:
                more, rest = self.end_tools()
                content, pieces = content + more, pieces + rest
        if self.num_unsent_tokens == 0 and not self.unsent_text and not content and not pieces:
            return None
        chunk = StreamChunk(
            id=self.queued.request.id,
            attempt=self.queued.attempt,
            seq=self.seq,
            index=self.index,
            token_ids=self.token_ids[len(self.token_ids) - self.num_unsent_tokens:],
            text="".join(self.unsent_text),
            logprobs=None if self.logprobs is None or not self.logprobs_asked
            else self.logprobs[len(self.logprobs) - self.num_unsent_tokens:],
            content=content,
            tool_calls=[ToolCallDelta(index=p.index, id=p.id, name=p.name, arguments=p.arguments)
                        for p in pieces] if pieces else None,
            resumed_at=self.resumed_at,
        )
        self.sent_text_len += len(chunk.text)
        self.seq += 1
        self.num_unsent_tokens = 0
        self.unsent_text = []
        self.last_flush = now
        return chunk


def _tool_parser(request) -> ToolCallParser | None:
    if request.effective_tool_choice == "none":
        return None
    return ToolCallParser(frozenset(t.function.name for t in request.tools), request.parallel_tool_calls)


def waits_of(queued: QueuedRequest, first_scheduled: float) -> tuple[float, float, float]:
    """Seconds the request waited in each of tenant_book.WAIT_STAGES before its first step (`first_scheduled`,
    monotonic): unread in Kafka, in the local queue, in the engine's waiting queue. A producer's clock ahead of
    ours makes no negative wait: each is at least 0."""
    scheduled_ms = time.time() * 1000.0 - (time.monotonic() - first_scheduled) * 1000.0
    read_ms = queued.read_ms or queued.timestamp_ms
    dispatched_ms = queued.dispatched_ms or read_ms
    return (max(0.0, read_ms - queued.timestamp_ms) / 1000.0, max(0.0, dispatched_ms - read_ms) / 1000.0,
            max(0.0, scheduled_ms - dispatched_ms) / 1000.0)


class Streamer:
    def __init__(
        self, publisher: Publisher, tracker: OffsetTracker, answers: Answers, metrics: WorkerMetrics,
        service: ServiceModel, worker_id: str, num_priorities: int, chunk_interval_ms: float, tenants: TenantBook,
    ) -> None:
        self.publisher = publisher
        self.tenants = tenants
        """Fair-share counters and quotas take the tokens each completion was really served."""
        self.answers = answers
        self.tracker = tracker
        self.metrics = metrics
        self.service = service
        self.worker_id = worker_id
        self.chunk_interval_s = chunk_interval_ms / 1000.0
        self.streams: dict[str, RequestStream] = {}
        """By engine request id: every request handed to the engine and not yet finished."""
        self.num_open_by_priority = [0] * num_priorities
        self.held_partitions: set = set()
        """Revoked in the rebalance under way: nothing of theirs is published until released or closed."""
        self._held_finals: list[tuple[RequestStream, RequestOutput]] = []
        self.num_completed = 0
        self.num_output_tokens = 0

    def __len__(self) -> int:
        return len(self.streams) + len(self._held_finals)

    def open(self, queued: QueuedRequest) -> None:
        """Streams for a request about to enter the engine: one per completion (queued.completion_engine_id)."""
        request = queued.request
        num = request.num_completions
        if num == 1:
            logprobs = [] if request.sampling.logprobs else None
            streams = [RequestStream(queued, logprobs=logprobs, tools=_tool_parser(request))]
        else:
            group = CompletionGroup(queued, [None] * num, [0.0] * num)
            streams = [RequestStream(queued, index, group, logprobs=[] if request.sampling.logprobs or group.ranked
                                     else None, tools=_tool_parser(request)) for index in range(num)]
            group.members = streams
        for stream in streams:
            done = queued.resumed(stream.index)
            if done is not None:
                stream.resume_from(done)
            self.streams[queued.completion_engine_id(stream.index)] = stream
        self.num_open_by_priority[queued.priority] += num

    def charged_in_engine(self) -> dict[tuple[str, int], float]:
        """(tenant, priority) -> the tokens charged on entry to its requests in the engine now, each completion
        its share (the fair share's in-flight figure, which other workers read from the status topic)."""
        charged: dict[tuple[str, int], float] = {}
        for stream in self.streams.values():
            queued = stream.queued
            key = (queued.tenant, queued.priority)
            charged[key] = charged.get(key, 0.0) + queued.charged_tokens / queued.request.num_completions
        return charged

    def progress_records(self, partition, full: bool = True) -> list[tuple[bytes, bytes]]:
        """(key, value) of a progress record (schemas/progress.py) for each request of `partition` that has
        delivered output a later attempt could continue from; not `full`: only those that have had none yet.
        Requests whose logprobs are asked for (or that rank best_of completions by them) are left out: they
        start over."""
        if partition in self.held_partitions:
            return []
        now_ms = int(time.time() * 1000)
        seen: set[int] = set()
        out = []
        for stream in self.streams.values():
            queued = stream.queued
            if queued.partition != partition or id(queued) in seen or not resumable(queued.request):
                continue
            seen.add(id(queued))
            members = stream.group.members if stream.group is not None else [stream]
            if not full and members[0].recorded:
                continue
            if stream.group is not None and (stream.group.ranked or stream.group.poisoned):
                continue
            completions = [m.progress() for m in members]
            if not any(c.token_ids for c in completions):
                continue
            first = members[0]
            mark = tuple((c.index, c.seq, len(c.token_ids)) for c in completions)
            if mark != first.progress_mark:
                # Earlier than the send of any chunk beyond this progress: a new owner reads its stream's tail
                # from there.
                first.progress_mark, first.progress_ts_ms = mark, now_ms
            record = ProgressRecord(id=queued.request.id, attempt=queued.attempt,
                                    partition=getattr(partition, "partition", 0), offset=queued.offset,
                                    topic=queued.reply_topic, completions=completions, worker_id=self.worker_id,
                                    ts_ms=first.progress_ts_ms)
            first.recorded = True
            out.append((queued.request.id.encode(), encode(record)))
        return out

    def close_where(self, predicate: Callable[[QueuedRequest], bool],
                    on_closed: Callable[[QueuedRequest], None]) -> list[str]:
        """Silence the streams whose request matches, and the finals held for them, passing each one's request
        to on_closed; returns their engine ids (for the engine's abort)."""
        ids = [eid for eid, stream in self.streams.items() if predicate(stream.queued)]
        for eid in ids:
            stream = self.streams.pop(eid)
            self.num_open_by_priority[stream.queued.priority] -= 1
            if not stream.started:
                self._started(stream)
            on_closed(stream.queued)
        for stream, _ in self._held_finals:
            if predicate(stream.queued):
                on_closed(stream.queued)
        self._held_finals = [(stream, out) for stream, out in self._held_finals if not predicate(stream.queued)]
        return ids

    def cancel(self, request_id: str, reason: str) -> list[str]:
        """Mark the streams of this wire id cancelled; returns their engine ids for the engine's abort, whose
        output then ends each with a `cancelled` final (its text so far). Ids already cancelled are skipped."""
        ids = [eid for eid, stream in self.streams.items()
               if stream.queued.request.id == request_id and stream.cancel_reason is None]
        for eid in ids:
            self.streams[eid].cancel_reason = reason
        return ids

    def hold(self, partitions: set) -> None:
        self.held_partitions |= partitions

    def release(self, partitions: set) -> None:
        """The assignment settles every held partition: these stay with this worker, so what their requests
        gathered meanwhile is published; the others were closed (close_where) before."""
        self.held_partitions = set()
        now = time.monotonic()
        for stream in self.streams.values():
            if stream.queued.partition in partitions and stream.sends_chunks:
                self._send_chunk(stream, now)
        finals = [(s, o) for s, o in self._held_finals if s.queued.partition in partitions]
        self._held_finals = [(s, o) for s, o in self._held_finals if s.queued.partition not in partitions]
        for stream, out in finals:
            self._finish(stream, out, now)

    async def handle(self, outputs: list[RequestOutput]) -> None:
        touched: dict[str, RequestStream] = {}
        finals: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # closed early: its partition is someone else's now
            if out.replayed:
                stream.start_replay()
                continue
            if not stream.started and (out.new_token_ids or out.finished):
                self._started(stream)
                if stream.index == 0 and out.first_scheduled_time is not None:
                    self.tenants.waited(stream.queued.tenant, waits_of(stream.queued, out.first_scheduled_time))
            stream.add(out)
            if out.finished:
                finals.append((stream, out))
                del self.streams[out.request_id]
                self.num_open_by_priority[stream.queued.priority] -= 1
            else:
                touched[out.request_id] = stream
        now = time.monotonic()
        held = self.held_partitions
        for stream in touched.values():
            if held and stream.queued.partition in held:
                continue
            # The first chunk goes at once (time to first token); later ones gather for chunk_interval_s.
            if stream.sends_chunks and (stream.seq == 0 or now - stream.last_flush >= self.chunk_interval_s):
                self._send_chunk(stream, now)
        for stream, out in finals:
            queued = stream.queued
            self.service.observe_finished(queued.num_prompt_tokens, queued.request.max_new_tokens,
                                          out.num_prompt_tokens, len(stream.token_ids),
                                          out.finish_reason in ("stop", "length"), now)
            self.tenants.served(queued.priority, queued.tenant, out.num_prompt_tokens if stream.index == 0 else 0,
                                len(stream.token_ids), queued.charged_tokens / queued.request.num_completions, now)
            if held and queued.partition in held:
                self._held_finals.append((stream, out))
            else:
                self._finish(stream, out, now)
        await self.publisher.wait_room()

    def _started(self, stream: RequestStream) -> None:
        stream.started = True
        queued = stream.queued
        self.tenants.started(queued.priority, queued.tenant, queued.charged_tokens / queued.request.num_completions)

    def _send_chunk(self, stream: RequestStream, now: float, last: bool = False) -> None:
        chunk = stream.take_chunk(now, last)
        if chunk is not None:
            mark = stream.mark()
            self.publisher.publish_nowait(stream.queued.reply_topic, chunk.id.encode(), encode(chunk),
                                          on_acked=lambda: stream.note_acked(mark))

    def _finish(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        queued, group = stream.queued, stream.group
        if group is not None and group.poisoned:
            return  # the request was answered with an error when another of its completions poisoned the engine
        if out.error_code == "poison_request":
            self.answers.dead_letter_request(queued, "poison_request", out.error_message or "")
            if group is not None:
                group.poisoned = True
            return
        if stream.replay_diverged:
            out = dataclasses.replace(out, finish_reason="error", error_code="internal", error_message=(
                "the engine failed on a step this request was in; it was run again from the start, and the "
                "tokens it produced differ from those already streamed"))
        if stream.sends_chunks:
            self._send_chunk(stream, now, last=True)
        content, tool_calls = stream.parsed_tool_calls()
        final = final_for_output(
            queued.request.id, queued.attempt, queued.timestamp_ms, queued.request.metadata, out,
            stream.token_ids, "".join(stream.text_parts), stream.seq, self.worker_id,
            logprobs=stream.logprobs if stream.logprobs_asked else None,
            predicted=(queued.predicted_queue_ms, queued.predicted_e2e_ms), cancelled=stream.cancel_reason,
            content=content, tool_calls=tool_calls,
        )
        if stream.resumed_at is not None:
            final = msgspec.structs.replace(final, resumed_at=stream.resumed_at)
        self.num_output_tokens += len(stream.token_ids)
        queued.trace.engine_done(out)
        if group is not None:
            self._finish_completion(stream, group, final)
            return
        self.num_completed += 1
        self._observe(final, queued)
        self.answers.request_final(queued, final)

    def _finish_completion(self, stream: RequestStream, group: CompletionGroup, final: FinalRecord) -> None:
        """One completion of a request with several ended: its final goes out (at once, or ranked when all are
        done for best_of > n); after the last one, the request-level final."""
        queued = group.queued
        group.finals[stream.index] = final
        group.scores[stream.index] = sum(lp.logprob for lp in stream.logprobs or ())
        group.num_chunks += stream.seq
        if not group.ranked:
            self._publish(queued, msgspec.structs.replace(final, index=stream.index))
        if any(f is None for f in group.finals):
            return
        finals: list[FinalRecord] = group.finals  # type: ignore[assignment]
        if group.ranked:
            # Highest cumulative logprob first (ties: lower index); completed ones before the others.
            order = sorted(range(len(finals)), key=lambda i: (finals[i].status != "completed", -group.scores[i], i))
            for rank, i in enumerate(order[:queued.request.n]):
                self._publish(queued, msgspec.structs.replace(finals[i], index=rank))
        request_final = group_final(finals, group.num_chunks, (queued.predicted_queue_ms, queued.predicted_e2e_ms),
                                    queued.timestamp_ms)
        self.num_completed += 1
        self._observe(request_final, queued)
        self.answers.request_final(queued, request_final)

    def _publish(self, queued: QueuedRequest, record: FinalRecord) -> None:
        self.answers.final(queued.partition, None, queued.reply_topic, record)

    def _observe(self, final, queued: QueuedRequest) -> None:
        priority = queued.priority
        self.tenants.finished(queued.tenant, final.status)
        m = self.metrics
        t = final.timings
        if final.status == "completed":
            m.completed_for(priority).inc()
        elif final.status == "cancelled":
            m.requests_cancelled.inc()
        else:
            m.rejected_for(final.reason).inc()
        if t.ttft_ms is not None:
            m.time_to_first_token.observe(t.ttft_ms / 1000.0)
        if t.queue_ms is not None:
            m.request_queue_time.observe(t.queue_ms / 1000.0)
        if t.e2e_ms is not None:
            m.e2e_request_latency.observe(t.e2e_ms / 1000.0)
        if t.tokens_per_s:
            m.inter_token_latency.observe(1.0 / t.tokens_per_s)
