"""The streamer against an in-memory publisher: contiguous chunks, one final per request whose acknowledgement
marks the record's offset done, and silence after a stream is closed (revocation)."""

from __future__ import annotations

import time

from aiokafka import TopicPartition

from schemas.progress import decode_progress
from schemas.request import ChatMessage, GenerationRequest
from schemas.tools import FunctionSpec, Tool
from worker.engine.api import RequestOutput
from worker.transport.requests.answers import Answers
from worker.transport.requests.local_queue import QueuedRequest
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.load.service_model import ServiceModel
from worker.transport.requests.streamer import Streamer
from tests.transport.fakes import TOPIC, FakePublisher, tenant_book


def queued(request_id: str, offset: int, stream: bool = True) -> QueuedRequest:
    return QueuedRequest(request=GenerationRequest(id=request_id, prompt="p", stream=stream),
                         partition=TopicPartition(TOPIC, 0), offset=offset, priority=1, attempt=3,
                         timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="llm.results",
                         num_prompt_tokens=1)


def make_streamer(publisher: FakePublisher, tracker: OffsetTracker) -> Streamer:
    metrics = WorkerMetrics.create()
    tenants = tenant_book()
    answers = Answers(publisher, tracker, metrics, "w", "llm.results", "llm.dead-letter", tenants=tenants)
    return Streamer(publisher, tracker, answers, metrics, ServiceModel(3, 64, 512), "w", 3, 0.0, tenants)


def output(q: QueuedRequest, token: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(q.engine_id, [token], f"<{token}>", finished=finished, finish_reason=reason,
                         num_prompt_tokens=1, num_output_tokens=1, arrival_time=time.monotonic())


async def test_chunks_then_one_final_and_the_offset_is_done_when_acknowledged():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    a, b, gone = queued("a", 0), queued("b", 1, stream=False), queued("gone", 2)
    for q in (a, b, gone):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    assert streamer.num_open_by_priority == [0, 3, 0]
    await streamer.handle([output(a, 1), output(b, 1), output(gone, 1)])
    closed = []
    assert streamer.close_where(lambda q: q.request.id == "gone", closed.append) == [gone.engine_id]
    assert closed == [gone]
    await streamer.handle([output(a, 2), output(b, 2, True, "length"), output(gone, 2)])
    await streamer.handle([output(a, 3, True, "stop")])
    chunks = publisher.chunks()
    assert [(c.id, c.seq, c.text) for c in chunks] == [("a", 0, "<1>"), ("gone", 0, "<1>"), ("a", 1, "<2>"),
                                                       ("a", 2, "<3>")]
    finals = publisher.finals()
    assert set(finals) == {"a", "b"}  # nothing more for the closed stream
    a_final = finals["a"]
    assert (a_final.status, a_final.text, a_final.num_chunks, a_final.attempt) == ("completed", "<1><2><3>", 3, 3)
    assert (finals["b"].finish_reason, finals["b"].text, finals["b"].num_chunks) == ("length", "<1><2>", 0)
    assert len(streamer) == 0 and streamer.num_completed == 2
    assert tracker.num_pending() == 3
    publisher.ack_all()
    assert tracker.num_pending() == 1  # "gone" stays pending: its next owner answers it
    assert tracker.watermark(a.partition) == 2


def replayed(q: QueuedRequest) -> RequestOutput:
    return RequestOutput(q.engine_id, [], "", replayed=True, arrival_time=time.monotonic())


async def test_a_replay_continues_the_stream_without_repeating_it():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    same, other = queued("same", 0), queued("other", 1)
    for q in (same, other):
        streamer.open(q)
    await streamer.handle([output(same, 1), output(same, 2), output(other, 1), output(other, 2)])
    await streamer.handle([replayed(same), replayed(other)])
    # The replay of "same" repeats 1, 2 and goes on; "other" comes back with a different second token.
    await streamer.handle([output(same, 1), output(other, 1)])
    await streamer.handle([output(same, 2), output(other, 9)])
    await streamer.handle([output(same, 3), output(other, 3)])
    await streamer.handle([output(same, 4, True, "length"), output(other, 4, True, "length")])
    chunks = [(c.id, c.seq, c.token_ids) for c in publisher.chunks()]
    assert [c for c in chunks if c[0] == "same"] == [("same", 0, [1, 2]), ("same", 1, [3]), ("same", 2, [4])]
    finals = publisher.finals()
    assert finals["same"].status == "completed" and finals["same"].text == "<1><2><3><4>"
    assert finals["same"].num_chunks == 3
    assert (finals["other"].status, finals["other"].reason) == ("error", "internal")
    assert "differ" in finals["other"].message


async def test_a_poison_request_is_dead_lettered_with_an_error_final():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    poison = queued("poison", 5)
    tracker.track(poison.partition, poison.offset)
    streamer.open(poison)
    await streamer.handle([RequestOutput(poison.engine_id, [], "", finished=True, finish_reason="error",
                                         error_code="poison_request", error_message="boom",
                                         arrival_time=time.monotonic())])
    final = publisher.finals()["poison"]
    assert (final.status, final.reason, final.message) == ("error", "poison_request", "boom")
    (dead,) = publisher.dead_letters()
    assert (dead.request_id, dead.offset, dead.error_code) == ("poison", 5, "poison_request")
    assert b'"id":"poison"' in dead.value  # the request, re-encoded, for an operator to inspect or replay
    publisher.ack_all()
    assert tracker.num_pending() == 0 and len(streamer) == 0


def queued_on(request_id: str, partition: int, offset: int) -> QueuedRequest:
    q = queued(request_id, offset)
    q.partition = TopicPartition(TOPIC, partition)
    q.engine_id = f"{request_id}#3@{partition}:{offset}"
    return q


async def test_held_during_a_rebalance_then_released_or_closed():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    stays, moves = queued_on("stays", 0, 0), queued_on("moves", 1, 0)
    for q in (stays, moves):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    await streamer.handle([output(stays, 1), output(moves, 1)])
    streamer.hold({stays.partition, moves.partition})  # revoked: fate unknown until the assignment
    await streamer.handle([output(stays, 2), output(moves, 2, True, "length")])
    await streamer.handle([output(stays, 3, True, "stop")])
    assert [(c.id, c.seq) for c in publisher.chunks()] == [("stays", 0), ("moves", 0)]
    assert publisher.finals() == {} and len(streamer) == 2  # both finals wait; shutdown would wait for them
    # The assignment: partition 1 went to another worker, partition 0 stayed.
    closed = []
    assert streamer.close_where(lambda q: q.partition == moves.partition, closed.append) == []  # final held
    assert closed == [moves]
    streamer.release({stays.partition})
    chunks = [(c.id, c.seq, c.token_ids) for c in publisher.chunks()]
    assert chunks == [("stays", 0, [1]), ("moves", 0, [1]), ("stays", 1, [2, 3])]  # no gap, same attempt
    finals = publisher.finals()
    assert set(finals) == {"stays"} and finals["stays"].text == "<1><2><3>" and finals["stays"].attempt == 3
    assert len(streamer) == 0 and streamer.held_partitions == set()


async def test_the_first_chunk_goes_at_once_and_later_tokens_gather_for_the_interval():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    streamer.chunk_interval_s = 3600.0
    a = queued("a", 0)
    tracker.track(a.partition, a.offset)
    streamer.open(a)
    for token in (1, 2, 3):
        await streamer.handle([output(a, token)])
    assert [c.token_ids for c in publisher.chunks()] == [[1]]  # time to first token is not held back
    await streamer.handle([output(a, 4, True, "length")])
    assert [(c.seq, c.token_ids) for c in publisher.chunks()] == [(0, [1]), (1, [2, 3, 4])]
    assert publisher.finals()["a"].num_chunks == 2


async def test_logprobs_follow_token_ids_across_chunks_replays_and_into_the_final():
    from schemas.request import SamplingSpec
    from worker.engine.api import TokenLogprobs

    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    q = QueuedRequest(request=GenerationRequest(id="lp", prompt="p", sampling=SamplingSpec(logprobs=True,
                                                                                           top_logprobs=2)),
                      partition=TopicPartition(TOPIC, 0), offset=0, priority=1, attempt=0,
                      timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="llm.results",
                      num_prompt_tokens=1)
    plain = queued("plain", 1)
    streamer.open(q)
    streamer.open(plain)

    def with_lp(token: int, finished: bool = False) -> RequestOutput:
        out = output(q, token, finished, "length" if finished else None)
        out.new_logprobs = [TokenLogprobs(token, -token / 10, [token, 99], [-token / 10, -5.0])]
        return out

    streamer.chunk_interval_s = 3600.0  # token 1 goes at once (the first chunk); tokens 2 and 3 gather
    await streamer.handle([with_lp(1), output(plain, 1)])
    await streamer.handle([with_lp(2)])
    streamer.chunk_interval_s = 0.0
    await streamer.handle([with_lp(3)])
    await streamer.handle([replayed(q)])
    await streamer.handle([with_lp(1)])
    await streamer.handle([with_lp(2)])
    await streamer.handle([with_lp(3)])
    await streamer.handle([with_lp(4, True), output(plain, 2, True, "length")])
    chunks = [c for c in publisher.chunks() if c.id == "lp"]
    assert [c.token_ids for c in chunks] == [[1], [2, 3], [4]]
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == chunk.token_ids
        assert [lp.logprob for lp in chunk.logprobs] == [-t / 10 for t in chunk.token_ids]
        assert [[t.token_id for t in lp.top_logprobs] for lp in chunk.logprobs] == [[t, 99] for t in chunk.token_ids]
    finals = publisher.finals()
    assert [lp.token_id for lp in finals["lp"].logprobs] == finals["lp"].token_ids == [1, 2, 3, 4]
    assert finals["plain"].logprobs is None
    assert all(c.logprobs is None for c in publisher.chunks() if c.id == "plain")


def completion_output(q: QueuedRequest, index: int, token: int, logprob: float | None = None,
                      reason: str | None = None) -> RequestOutput:
    from worker.engine.api import TokenLogprobs
    return RequestOutput(q.completion_engine_id(index), [token], f"<{token}>", finished=reason is not None,
                         finish_reason=reason, num_prompt_tokens=5, num_output_tokens=1, num_cached_tokens=4 * index,
                         arrival_time=time.monotonic(),
                         new_logprobs=None if logprob is None else [TokenLogprobs(token, logprob)])


async def test_n_completions_stream_by_index_and_the_request_level_final_comes_last():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    q = QueuedRequest(request=GenerationRequest(id="n", prompt="p", n=2), partition=TopicPartition(TOPIC, 0),
                      offset=7, priority=1, attempt=3, timestamp_ms=int(time.time() * 1000), deadline_ms=None,
                      reply_topic="llm.results", num_prompt_tokens=1)
    tracker.track(q.partition, q.offset)
    streamer.open(q)
    assert streamer.num_open_by_priority == [0, 2, 0] and len(streamer) == 2
    await streamer.handle([completion_output(q, 0, 1), completion_output(q, 1, 2)])
    await streamer.handle([completion_output(q, 1, 3, reason="length")])
    finals = publisher.all_finals()
    assert [(f.index, f.text, f.num_chunks) for f in finals] == [(1, "<2><3>", 2)]  # completion 1, at once
    publisher.ack_all()
    assert tracker.num_pending() == 1  # a completion's final does not finish the request
    await streamer.handle([completion_output(q, 0, 4, reason="stop")])
    chunks = publisher.chunks()
    assert sorted((c.index, c.seq, c.text) for c in chunks) == [(0, 0, "<1>"), (0, 1, "<4>"), (1, 0, "<2>"),
                                                                (1, 1, "<3>")]
    finals = publisher.all_finals()
    assert [f.index for f in finals] == [1, 0, None]
    request_final = finals[-1]
    assert (request_final.status, request_final.finish_reason, request_final.text) == ("completed", "length", None)
    assert (request_final.usage.prompt_tokens, request_final.usage.completion_tokens,
            request_final.usage.cached_tokens, request_final.num_chunks) == (5, 4, 4, 4)
    assert len(streamer) == 0 and streamer.num_completed == 1
    publisher.ack_all()
    assert tracker.num_pending() == 0


async def test_best_of_returns_the_n_completions_of_highest_cumulative_logprob_ranked_and_sends_no_chunks():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    q = QueuedRequest(request=GenerationRequest(id="b", prompt="p", n=2, best_of=3),
                      partition=TopicPartition(TOPIC, 0), offset=1, priority=1, attempt=0,
                      timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="llm.results",
                      num_prompt_tokens=1)
    tracker.track(q.partition, q.offset)
    streamer.open(q)
    # Cumulative logprobs: completion 0 -> -3.0, 1 -> -0.5, 2 -> -1.0.
    await streamer.handle([completion_output(q, 0, 10, -1.0), completion_output(q, 1, 11, -0.25),
                           completion_output(q, 2, 12, -0.5)])
    await streamer.handle([completion_output(q, 0, 20, -2.0, "stop"), completion_output(q, 1, 21, -0.25, "stop")])
    assert publisher.all_finals() == [] and publisher.chunks() == []  # nothing before all three are done
    await streamer.handle([completion_output(q, 2, 22, -0.5, "length")])
    finals = publisher.all_finals()
    assert [(f.index, f.text) for f in finals] == [(0, "<11><21>"), (1, "<12><22>"), (None, None)]
    assert all(f.logprobs is None for f in finals)  # gathered to rank, not asked for
    assert finals[-1].usage.completion_tokens == 6 and finals[-1].num_chunks == 0
    assert publisher.chunks() == []
    publisher.ack_all()
    assert tracker.num_pending() == 0


def tool_request(request_id: str, offset: int, stream: bool, tool_choice: str = "auto") -> QueuedRequest:
    request = GenerationRequest(id=request_id, messages=[ChatMessage(role="user", content="Time in Paris?")],
                                stream=stream, tool_choice=tool_choice,
                                tools=[Tool(function=FunctionSpec(name="get_time"))])
    return QueuedRequest(request=request, partition=TopicPartition(TOPIC, 0), offset=offset, priority=1, attempt=0,
                         timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="llm.results",
                         num_prompt_tokens=1)


async def test_tool_calls_are_parsed_into_chunks_and_the_final_streamed_or_not():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    streamed, whole, off = tool_request("s", 0, True), tool_request("w", 1, False), tool_request("o", 2, True, "none")
    deltas = ["On it.\n<tool", '_call>\n{"name": "get_time", "argu', 'ments": {"tz": "C', 'ET"}}\n</tool_call>']
    for q in (streamed, whole, off):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        await streamer.handle([RequestOutput(q.engine_id, [i], delta, finished=last, finish_reason="stop" if last
                                             else None, num_prompt_tokens=1, num_output_tokens=1,
                                             arrival_time=time.monotonic()) for q in (streamed, whole, off)])
    finals = publisher.finals()
    text = "".join(deltas)
    for request_id in ("s", "w"):
        final = finals[request_id]
        assert (final.finish_reason, final.reason, final.text, final.content) == ("tool_calls", "tool_calls", text,
                                                                                  "On it.")
        [call] = final.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_time", '{"tz": "CET"}')
    assert (finals["o"].finish_reason, finals["o"].tool_calls, finals["o"].content) == ("stop", None, None)
    chunks = [c for c in publisher.chunks() if c.id == "s"]
    assert "".join(c.text for c in chunks) == text and "".join(c.content for c in chunks) == "On it."
    pieces = [p for c in chunks for p in c.tool_calls or ()]
    assert pieces[0].id == finals["s"].tool_calls[0].id and pieces[0].name == "get_time"
    assert "".join(p.arguments for p in pieces) == '{"tz": "CET"}'
    assert all(c.content is None and c.tool_calls is None for c in publisher.chunks() if c.id == "o")


async def test_a_progress_record_of_unchanged_progress_is_the_one_before_byte_for_byte():
    """The lanes skip a full round of progress that repeats the last one by comparing its records: a record
    stamped with the time of asking would never repeat. Its time is when its progress was first recorded, so
    the next owner still reads the stream's tail from before any chunk the record does not hold."""
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    a, b = queued("a", 0), queued("b", 1, stream=False)
    for q in (a, b):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    await streamer.handle([output(a, 1), output(b, 1)])
    publisher.ack_all()
    first = streamer.progress_records(a.partition, True)
    assert [key for key, _ in first] == [b"a", b"b"]
    time.sleep(0.005)
    assert streamer.progress_records(a.partition, True) == first
    await streamer.handle([output(a, 2)])
    assert streamer.progress_records(a.partition, True) == first  # its chunk not acknowledged yet
    publisher.ack_all()
    moved = dict(streamer.progress_records(a.partition, True))
    assert moved[b"b"] == dict(first)[b"b"] and moved[b"a"] != dict(first)[b"a"]
    assert decode_progress(moved[b"a"]).ts_ms > decode_progress(dict(first)[b"a"]).ts_ms


async def test_the_charges_in_the_engine_are_the_open_streams_until_a_final_or_a_close():
    """Streamer.charged_in_engine, the in-flight figure other workers read: a request counts its charge while its
    streams are open, each of n completions its share, and stops at its final or when its partition moves."""
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    a, b, moved = queued("a", 0), queued("b", 1), queued("moved", 2)
    a.tenant, b.tenant, moved.tenant = "x", "y", "x"
    b.request = GenerationRequest(id="b", prompt="p", n=2)
    for q, charged in ((a, 40.0), (b, 30.0), (moved, 10.0)):
        q.charged_tokens = charged
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    assert streamer.charged_in_engine() == {("x", 1): 50.0, ("y", 1): 30.0}
    await streamer.handle([output(a, 1, True, "stop")])
    streamer.close_where(lambda q: q.request.id == "moved", lambda q: None)
    assert streamer.charged_in_engine() == {("y", 1): 30.0}
    await streamer.handle([RequestOutput(b.completion_engine_id(0), [1], "<1>", finished=True, finish_reason="stop",
                                         num_prompt_tokens=1, num_output_tokens=1, arrival_time=time.monotonic())])
    assert streamer.charged_in_engine() == {("y", 1): 15.0}  # one of its two completions still runs
