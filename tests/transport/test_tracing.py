"""Tracing off costs nothing, and a record without a traceparent is not traced (worker/transport/requests/tracing.py);
the spans' OTLP encoding is the SDK's message (otlp.py); the spans through the real broker are in
test_fleet_kafka.py."""

import types

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode

from schemas.decode import encode
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, Usage
from worker.transport.requests.local_queue import QueuedRequest
from worker.transport.requests.otlp import encode_request
from worker.transport.requests.tracing import OTEL_ENV, NoTracing, RequestTracing


def _queued(request_id: str = "r1") -> QueuedRequest:
    return QueuedRequest(request=GenerationRequest(id=request_id, prompt="p", max_new_tokens=3), partition=2,
                         offset=7, priority=1, attempt=1, timestamp_ms=1_700_000_000_000, deadline_ms=None,
                         reply_topic="llm.results", num_prompt_tokens=1)


def test_off_without_a_configured_exporter(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert isinstance(RequestTracing.from_env(), NoTracing)


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
    assert tracing.begin([("traceparent", parent)], b"r2", _queued("r2")) is None  # nothing kept but the header
    final = encode(FinalRecord(id="r2", attempt=1, status="rejected", reason="shed"))
    assert tracing.headers_for(b"r2", final) == [("traceparent", parent)]
    assert spans.get_finished_spans() == ()
    assert tracing.begin([("traceparent", b"00-zz-11-01")], b"r3", _queued("r3")) is None  # malformed: untraced


def _finished_spans(provider_kwargs=None):
    """The worker's spans for two requests (one through the engine, one that failed), plus an SDK span with
    every attribute type and an event."""
    spans = InMemorySpanExporter()
    provider = TracerProvider(**(provider_kwargs or {}))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("t", "1.2"), model="m")
    trace = tracing.begin([("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")], b"a",
                          _queued("a"))
    trace.engine_done(types.SimpleNamespace(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                                            finish_time=3.0))
    tracing.headers_for(b"a", encode(FinalRecord(id="a", attempt=1, status="completed", reason="length",
                                                 finish_reason="length", usage=Usage(prompt_tokens=3,
                                                                                     completion_tokens=2))))
    tracing.begin([("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")], b"b", _queued("b"))
    tracing.headers_for(b"b", encode(FinalRecord(id="b", attempt=1, status="error", reason="internal",
                                                 message="boom")))
    with provider.get_tracer("other").start_as_current_span("sdk", attributes={
            "s": "é", "b": False, "i": -5, "big": 2**62, "f": 0.25, "raw": b"\x00", "strs": ["x", "y"],
            "ints": [1, -1], "bools": [True]}) as span:
        span.set_status(StatusCode.OK)
    with provider.get_tracer("other").start_as_current_span("with-event") as span:
        span.add_event("e", {"k": 1})
    return list(spans.get_finished_spans())


def _flat(request: ExportTraceServiceRequest) -> list:
    return sorted(((rs.resource, ss.scope, span) for rs in request.resource_spans for ss in rs.scope_spans
                   for span in ss.spans), key=lambda t: t[2].span_id)


def test_the_hand_encoding_is_the_sdks_otlp_message():
    finished = _finished_spans()
    assert sorted(s.name for s in finished) == sorted(["llm.request", "queued", "admitted", "prefill", "decode",
                                                       "publish", "llm.request", "queued", "publish", "sdk",
                                                       "with-event"])
    ours = [s for s in finished if s.name != "with-event"]
    # Spans the hand encoding takes: the same message, field for field.
    assert ExportTraceServiceRequest.FromString(encode_request(ours)) == encode_spans(ours)
    # With one it leaves to the SDK's encoder: the same spans, resources and scopes.
    mixed = ExportTraceServiceRequest.FromString(encode_request(finished))
    assert _flat(mixed) == _flat(encode_spans(finished))
    root = next(s for s in finished if s.name == "llm.request" and s.attributes["messaging.message.id"] == "b")
    assert root.status.status_code == StatusCode.ERROR and root.attributes["llm_worker.reason"] == "internal"


def test_a_sampler_here_can_drop_what_the_producer_sampled():
    spans = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("t"))
    parent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert tracing.begin([("traceparent", parent)], b"r", _queued("r")) is None
    [(name, header)] = tracing.headers_for(b"r", encode(FinalRecord(id="r", attempt=1, status="rejected",
                                                                     reason="shed")))
    assert header.startswith(b"00-4bf92f3577b34da6a3ce929d0e0e4736-") and header.endswith(b"-00")
    assert spans.get_finished_spans() == ()


def test_the_oldest_traces_are_forgotten_and_their_spans_ended(monkeypatch):
    import worker.transport.requests.tracing as tracing_module

    monkeypatch.setattr(tracing_module, "MAX_OPEN_TRACES", 2)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("t"))
    tracing.begin([("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")], b"x", _queued("x"))
    for key in (b"y", b"z"):
        tracing.begin([("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")], key,
                      _queued(key.decode()))
    assert tracing.headers_for(b"x", b"{}") is None and tracing.headers_for(b"z", b"{}") is not None
    assert sorted(s.name for s in spans.get_finished_spans()) == ["llm.request", "publish", "queued"]
