"""Cancellation without a broker: the TTL map of cancelled ids, the cancel record, the `cancelled` final built
from an engine abort (streamer) or without the engine (intake, dispatcher), and the local queue's take_where.
The broker-level behaviour is in test_cancel_kafka.py."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from schemas import CancelRecord, FinalRecord, decode_control, decode_result, encode
from schemas.export import JSON_DIR, schema_path
from worker.engine.api import RequestOutput
from worker.transport.requests.cancels import CancelledIds
from worker.transport.requests.local_queue import LocalQueue
from worker.transport.kafka.offsets import OffsetTracker
from tests.transport.fakes import FakePublisher
from tests.transport.test_intake import build, send
from tests.transport.test_streamer import make_streamer, output, queued

T0 = 1_700_000_000_000.0


# ---- the TTL map ------------------------------------------------------------------------------------------------


def test_a_cancel_lives_its_ttl_from_the_record_timestamp():
    ids = CancelledIds(ttl_s=10, max_ids=100)
    assert ids.add("a", T0, now_ms=T0 + 1000, reason="why").reason == "why"
    assert ids.get("a", T0 + 9_999) is not None
    assert ids.get("b", T0 + 1) is None
    assert ids.get("a", T0 + 10_000) is None  # expired: forgotten
    assert len(ids) == 0 and ids.num_expired == 1


def test_a_record_older_than_the_ttl_is_not_kept():
    ids = CancelledIds(ttl_s=10, max_ids=100)
    assert ids.add("old", T0, now_ms=T0 + 10_001) is None  # read back at start-up, long answered
    assert len(ids) == 0


def test_a_timestamp_from_the_future_counts_from_now():
    ids = CancelledIds(ttl_s=10, max_ids=100)
    cancel = ids.add("a", T0 + 3_600_000, now_ms=T0)  # the producer's clock runs an hour ahead
    assert cancel.expires_ms == T0 + 10_000


def test_the_oldest_are_evicted_past_the_size_cap():
    ids = CancelledIds(ttl_s=100, max_ids=3)
    for i in range(5):
        ids.add(f"r{i}", T0 + i, now_ms=T0 + i)
    assert len(ids) == 3 and ids.num_evicted == 2
    assert [ids.get(f"r{i}", T0 + 10) is not None for i in range(5)] == [False, False, True, True, True]


def test_expiry_sweeps_from_the_oldest_on_add():
    ids = CancelledIds(ttl_s=1, max_ids=100)
    for i in range(50):
        ids.add(f"r{i}", T0, now_ms=T0)
    ids.add("late", T0 + 5_000, now_ms=T0 + 5_000)
    assert len(ids) == 1 and ids.num_expired == 50


def test_a_repeated_cancel_keeps_its_reason_and_extends_its_life():
    ids = CancelledIds(ttl_s=10, max_ids=100)
    ids.add("a", T0, now_ms=T0, reason="first")
    again = ids.add("a", T0 + 5_000, now_ms=T0 + 5_000)
    assert again.reason == "first" and again.expires_ms == T0 + 15_000
    assert ids.num_added == 1 and len(ids) == 1


@pytest.mark.parametrize("ttl_s, max_ids", [(0, 10), (-1, 10), (10, 0)])
def test_nonsense_bounds_are_refused(ttl_s, max_ids):
    with pytest.raises(ValueError):
        CancelledIds(ttl_s, max_ids)


# ---- wire records -----------------------------------------------------------------------------------------------


def test_cancel_record_round_trip_and_schema():
    import jsonschema

    record = CancelRecord(id="req-42", reason="user pressed stop")
    wire = encode(record)
    assert json.loads(wire) == {"schema_version": 1, "kind": "cancel", "id": "req-42", "reason": "user pressed stop"}
    assert decode_control(wire) == record
    assert decode_control(b'{"kind":"cancel","id":"x","added_later":1}') == CancelRecord(id="x")
    assert decode_control(b'{"id":"x"}') == CancelRecord(id="x")  # lenient: the schema asks for kind
    schema = json.loads(schema_path(JSON_DIR, "control_record").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(wire))
    for bad in (b'{"kind":"pause","id":"x"}', b'{"kind":"cancel"}', b'{"kind":"cancel","id":"has space"}', b"nope"):
        with pytest.raises(msgspec.DecodeError):
            decode_control(bad)


def test_a_cancelled_final_decodes_and_validates():
    import jsonschema

    final = FinalRecord(id="a", status="cancelled", reason="cancelled", message="m", text="<1>", token_ids=[1])
    assert decode_result(encode(final)) == final
    schema = json.loads(schema_path(JSON_DIR, "result").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(encode(final)))
    with pytest.raises(ValueError):
        FinalRecord(id="a", status="cancelled", reason="cancelled", finish_reason="abort")


# ---- the streamer: an abort of a cancelled stream ends it `cancelled` --------------------------------------------


async def test_an_aborted_cancelled_stream_ends_cancelled_with_its_text_so_far():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    a, other = queued("a", 0), queued("other", 1)
    for q in (a, other):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    await streamer.handle([output(a, 1), output(other, 1)])
    assert streamer.cancel("a", "no longer needed") == [a.engine_id]
    assert streamer.cancel("a", "again") == []  # already cancelled
    assert streamer.cancel("unknown", "") == []
    # The step that ran before the abort still counts; then the engine's abort output.
    await streamer.handle([output(a, 2), output(other, 2)])
    abort = RequestOutput(a.engine_id, [], "", finished=True, finish_reason="abort", num_prompt_tokens=1,
                          num_output_tokens=2, arrival_time=time.monotonic())
    await streamer.handle([abort])
    final = publisher.finals()["a"]
    chunks = [c for c in publisher.chunks() if c.id == "a"]
    assert (final.status, final.reason, final.finish_reason) == ("cancelled", "cancelled", None)
    assert final.text == "<1><2>" == "".join(c.text for c in chunks) and final.token_ids == [1, 2]
    assert final.num_chunks == len(chunks) and final.usage.completion_tokens == 2
    assert "after 2 output tokens" in final.message and "no longer needed" in final.message
    assert tracker.to_commit() == {a.partition: 0}  # done once Kafka acknowledges the final
    publisher.ack_all()
    assert tracker.to_commit() == {a.partition: 1}
    assert "other" not in publisher.finals() and len(streamer) == 1
    assert streamer.metrics.requests_cancelled._value.get() == 1


# ---- without the engine: intake and dispatcher -------------------------------------------------------------------


def with_cancels(w, *request_ids: str):
    ids = w.lifecycle.cancels
    now = time.time() * 1000
    for rid in request_ids:
        ids.add(rid, now, now, reason="stop it")
    return ids


async def test_a_request_read_after_its_cancel_is_answered_at_once_and_never_runs():
    w = build()
    with_cancels(w, "gone")
    tp, offset = send(w, 1, "gone", metadata={"k": "v"})
    send(w, 1, "kept")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    assert [r.request_id.split("#")[0] for r in w.engine.added] == ["kept"]
    final = w.publisher.finals()["gone"]
    assert (final.status, final.reason, final.text, final.token_ids) == ("cancelled", "cancelled", "", [])
    assert final.metadata == {"k": "v"} and "before it ran" in final.message and "stop it" in final.message
    w.publisher.ack_all()
    assert w.tracker.to_commit()[tp] == offset + 1


async def test_a_queued_request_whose_cancel_arrives_is_answered_by_the_dispatcher():
    w = build()
    send(w, 2, "later")
    await w.intake.fetch_once()
    assert len(w.queue) == 1
    with_cancels(w, "later")
    w.dispatcher.admit()
    assert w.engine.added == [] and w.publisher.finals()["later"].status == "cancelled"


def test_take_where_removes_only_the_matches_and_frees_space():
    queue = LocalQueue(2, max_waiting=3)
    for i, priority in enumerate([0, 1, 0]):
        q = queued(f"r{i}", i)
        q.priority = priority
        queue.push(q)
    assert not queue.space.is_set()
    taken = queue.take_where(lambda q: q.request.id == "r1")
    assert [q.request.id for q in taken] == ["r1"] and len(queue) == 2 and queue.space.is_set()
    assert queue.take_where(lambda q: False) == []


async def test_every_completion_of_a_request_with_n_stops_and_the_request_ends_cancelled():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = make_streamer(publisher, tracker)
    q = queued("multi", 0)
    q.request = msgspec.structs.replace(q.request, n=2)
    tracker.track(q.partition, q.offset)
    streamer.open(q)
    ids = [q.completion_engine_id(i) for i in range(2)]

    def out(engine_id, token, reason=None):
        return RequestOutput(engine_id, [] if reason else [token], "" if reason else f"<{token}>",
                             finished=reason is not None, finish_reason=reason, num_prompt_tokens=1,
                             num_output_tokens=1, arrival_time=time.monotonic())

    await streamer.handle([out(ids[0], 1), out(ids[1], 2)])
    assert sorted(streamer.cancel("multi", "")) == sorted(ids)
    await streamer.handle([out(ids[0], 0, "abort"), out(ids[1], 0, "abort")])
    finals = publisher.all_finals()
    assert [(f.index, f.status, f.text) for f in finals[:2]] == [(0, "cancelled", "<1>"), (1, "cancelled", "<2>")]
    assert (finals[-1].index, finals[-1].status, finals[-1].reason) == (None, "cancelled", "cancelled")
    assert finals[-1].usage.completion_tokens == 2 and len(streamer) == 0


@pytest.mark.slow  # ~1.2 s: in the full suite, not the fast subset
async def test_an_aborts_final_reaches_the_loop_before_the_next_step_ends():
    """A cancel's final goes out as soon as the engine thread applied the abort, not with the next step's outputs."""
    import asyncio

    from worker.engine.api import EngineRequest, SamplingParams
    from worker.engine.instant import InstantEngine
    from worker.transport.requests.engine_thread import EngineThread

    step_s = 0.4
    outputs: asyncio.Queue = asyncio.Queue()
    engine = InstantEngine(step_time_s=step_s)
    thread = EngineThread(engine, asyncio.get_running_loop(), outputs)
    thread.start()
    try:
        for rid in ("victim", "other"):
            thread.add(EngineRequest(rid, prompt=rid, sampling=SamplingParams(max_new_tokens=1000)))
        await outputs.get()  # the first step ran; the second is under way
        thread.abort(["victim"])
        asked = time.monotonic()
        async with asyncio.timeout(5):
            while not any(o.finished for o in await outputs.get()):
                pass
        # At most the rest of the step under way, never that step plus the next one.
        assert time.monotonic() - asked < 1.5 * step_s
        assert engine.stats().num_running == 1
    finally:
        thread.stop()
