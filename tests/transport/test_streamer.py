"""The streamer against an in-memory publisher: contiguous chunks, one final per request whose acknowledgement
marks the record's offset done, and silence after a stream is closed (revocation)."""

from __future__ import annotations

import time

from aiokafka import TopicPartition

from schemas.request import GenerationRequest
from worker.engine.api import RequestOutput
from worker.transport.local_queue import QueuedRequest
from worker.transport.metrics import WorkerMetrics
from worker.transport.offsets import OffsetTracker
from worker.transport.shedding import CompletionRate
from worker.transport.streamer import Streamer
from tests.transport.fakes import TOPIC, FakePublisher


def queued(request_id: str, offset: int, stream: bool = True) -> QueuedRequest:
    return QueuedRequest(request=GenerationRequest(id=request_id, prompt="p", stream=stream),
                         partition=TopicPartition(TOPIC, 0), offset=offset, priority=1, attempt=3,
                         timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="llm.results",
                         num_prompt_tokens=1)


def output(q: QueuedRequest, token: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(q.engine_id, [token], f"<{token}>", finished=finished, finish_reason=reason,
                         num_prompt_tokens=1, num_output_tokens=1, arrival_time=time.monotonic())


async def test_chunks_then_one_final_and_the_offset_is_done_when_acknowledged():
    publisher, tracker = FakePublisher(), OffsetTracker()
    streamer = Streamer(publisher, tracker, WorkerMetrics.create(), CompletionRate(), "w", 3, 0.0)
    a, b, gone = queued("a", 0), queued("b", 1, stream=False), queued("gone", 2)
    for q in (a, b, gone):
        tracker.track(q.partition, q.offset)
        streamer.open(q)
    assert streamer.num_open_by_priority == [0, 3, 0]
    await streamer.handle([output(a, 1), output(b, 1), output(gone, 1)])
    assert streamer.close_where(lambda q: q.request.id == "gone") == [gone.engine_id]
    await streamer.handle([output(a, 2), output(b, 2, True, "length"), output(gone, 2)])
    await streamer.handle([output(a, 3, True, "stop")])
    chunks = publisher.chunks()
    assert [(c.id, c.seq, c.text) for c in chunks] == [("a", 0, "<1>"), ("gone", 0, "<1>"), ("a", 1, "<2>"),
                                                       ("a", 2, "<3>")]
    finals = publisher.finals()
    assert set(finals) == {"a", "b"}  # nothing more for the closed stream
    assert (finals["a"].status, finals["a"].text, finals["a"].num_chunks, finals["a"].attempt) == ("completed", "<1><2><3>", 3, 3)
    assert (finals["b"].finish_reason, finals["b"].text, finals["b"].num_chunks) == ("length", "<1><2>", 0)
    assert len(streamer) == 0 and streamer.num_completed == 2
    assert tracker.num_pending() == 3
    publisher.ack_all()
    assert tracker.num_pending() == 1  # "gone" stays pending: its next owner answers it
    assert tracker.watermark(a.partition) == 2
