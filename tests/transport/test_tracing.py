"""Tracing off costs nothing, and a record without a traceparent is not traced (worker/transport/requests/tracing.py);
the spans through the real broker are in test_fleet_kafka.py."""

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.decode import encode
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, Usage
from worker.transport.requests.local_queue import QueuedRequest
from worker.transport.requests.tracing import OTEL_ENV, RequestTracing


def _queued(request_id: str = "r1") -> QueuedRequest:
    return QueuedRequest(request=GenerationRequest(id=request_id, prompt="p", max_new_tokens=3), partition=2,
                         offset=7, priority=1, attempt=1, timestamp_ms=1_700_000_000_000, deadline_ms=None,
                         reply_topic="llm.results", num_prompt_tokens=1)


def test_off_without_a_configured_exporter(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert RequestTracing.from_env() is None


def test_only_records_with_a_traceparent_are_traced_and_a_final_ends_the_spans():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("t"), model="m")
    assert tracing.begin([("other", b"x")], b"r0", _queued("r0")) is None
    assert tracing.headers_for(b"r0", b"{}") is None
    parent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    trace = tracing.begin([("traceparent", parent)], b"r1", _queued())
    assert trace is not None and spans.get_finished_spans() == ()
    headers = tracing.headers_for(b"r1", b'{"kind":"chunk"}')
    assert headers[0][1].startswith(b"00-4bf92f3577b34da6a3ce929d0e0e4736-")
    final = encode(FinalRecord(id="r1", attempt=1, status="rejected", reason="shed", usage=Usage(prompt_tokens=1)))
    assert tracing.headers_for(b"r1", final) == headers
    assert tracing.headers_for(b"r1", final) == headers  # a final built into a second batch keeps its header
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["llm.request", "publish", "queued"]  # answered without the engine: it only waited
    root = next(s for s in spans.get_finished_spans() if s.name == "llm.request")
    assert root.attributes["llm_worker.reason"] == "shed" and root.attributes["gen_ai.request.model"] == "m"


def test_an_unsampled_trace_is_carried_on_and_nothing_is_recorded():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("t"))
    parent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    trace = tracing.begin([("traceparent", parent)], b"r2", _queued("r2"))
    assert trace is not None and trace.span is None
    final = encode(FinalRecord(id="r2", attempt=1, status="rejected", reason="shed"))
    assert tracing.headers_for(b"r2", final) == [("traceparent", parent)]
    assert spans.get_finished_spans() == ()
    assert tracing.begin([("traceparent", b"00-zz-11-01")], b"r3", _queued("r3")) is None  # malformed: untraced
