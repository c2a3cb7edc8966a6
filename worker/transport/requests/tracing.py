"""OpenTelemetry traces through Kafka headers: a request record's W3C `traceparent` header continues into the
worker's spans, and the request's result records carry the trace on in their headers.

Per traced request (its record has a `traceparent` header), one `llm.request` span (kind CONSUMER, from the
record's timestamp to its final record being handed to the producer), child of the producer's span, with
children built afterwards from the timings the engine reports (RequestOutput), never inside the engine:

    queued   record timestamp -> handed to the engine (Kafka and the local queue)
    admitted handed to the engine -> first scheduled (waiting inside the engine)
    prefill  first scheduled -> first token
    decode   first token -> last token
    publish  final record built -> handed to the producer

and `gen_ai.*` attributes (operation, model, max tokens, input and output tokens, finish reason). Chunks and
finals get a `traceparent` header naming the `llm.request` span (same trace id as the producer's).

On only when the OpenTelemetry SDK is installed (the `otel` extra) and configured: the SDK's own variables
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_TRACES_EXPORTER=otlp`; OTLP over HTTP) or a tracer provider set by
the embedding program (as the tests do). Off, nothing is imported and the hot paths test one attribute.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from schemas.result import FinalRecord

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
OTEL_ENV = ("OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
            "OTEL_RESOURCE_ATTRIBUTES")
"""The SDK's variables a deployment may set (deploy/worker.yaml names some; tests/test_deploy.py checks them)."""
MAX_OPEN_TRACES = 20_000
"""Traced requests remembered (their header and span); past it the oldest are forgotten, and ended if their
final never passed the publisher (one sent on another path must not hold its span forever)."""
_FINAL_PREFIX = b'{"kind":"final"'
"""msgspec writes the tag field first: a result record starting so is a final."""
_final_decoder = msgspec.json.Decoder(FinalRecord)


def _parse(traceparent: bytes) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C traceparent (00-<32 hex trace id>-<16 hex span id>-<2 hex flags>),
    or None when malformed. Parsed here rather than by the SDK's propagator: it runs for every traced record."""
    parts = traceparent.split(b"-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2 or parts[0] == b"ff":
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    return (trace_id, span_id, flags) if trace_id and span_id else None


def _parent_context(trace_id: int, span_id: int, flags: int):
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0x01))
    return set_span_in_context(NonRecordingSpan(parent))


def _epoch_offset_ns() -> int:
    """Add to time.monotonic() * 1e9 to get epoch nanoseconds (the engine's timings are monotonic)."""
    return time.time_ns() - time.monotonic_ns()


@dataclass(slots=True)
class RequestTrace:
    """One traced request: its span, the header its result records carry, and the engine's timings."""

    span: object | None
    """None when the producer did not sample the trace (its context is carried on, nothing recorded)."""
    headers: list[tuple[str, bytes]]
    engine_times: tuple | None = None
    """(arrival, first scheduled, first token, finish), monotonic seconds, from the engine's last output."""
    final_built_ns: int | None = None
    ended: bool = False

    def engine_done(self, out) -> None:
        """The engine's final output for the request (streamer.py): keep its timings for the child spans."""
        if self.span is None:
            return
        self.engine_times = (out.arrival_time, out.first_scheduled_time, out.first_token_time, out.finish_time)
        self.final_built_ns = time.time_ns()


@dataclass(slots=True)
class RequestTracing:
    tracer: object
    model: str = ""
    _open: OrderedDict = field(default_factory=OrderedDict)
    _offset_ns: int = field(default_factory=_epoch_offset_ns)

    @classmethod
    def from_env(cls, model: str = "") -> "RequestTracing | None":
        """The tracing of this process, or None when it is off (no SDK, or nothing configured)."""
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError:
            return None
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or os.environ.get("OTEL_TRACES_EXPORTER") == "otlp"):
                return None
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get(
                "OTEL_SERVICE_NAME", "llm-worker")}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(provider)
            log.info("tracing: OTLP export to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the default"))
        tracing = cls(provider.get_tracer("kafka-llm-worker"), model)
        # The SDK, its exporter and their imports (protobuf, requests) are tens of thousands of objects that
        # live as long as the process: out of the collector's sight, as the engine's start-up objects are, so
        # that full collections do not walk them again and again.
        gc.collect()
        gc.freeze()
        return tracing

    # -- a request record read ------------------------------------------------------------------------------
    def begin(self, headers, key: bytes, queued) -> RequestTrace | None:
        """A request record was read: None unless it carries a traceparent (it is then traced)."""
        parent = None
        for name, value in headers or ():
            if name == TRACEPARENT:
                parent = value
                break
        if parent is None:
            return None
        if len(parent) == 55 and parent.endswith(b"-00") and parent.startswith(b"00-"):
            ids = None  # unsampled, the usual case: nothing here needs its ids
        else:
            ids = _parse(parent)
            if ids is None:
                return None
        if ids is None or not ids[2] & 0x01:
            # The producer did not sample this trace: its context travels on unchanged, and no span is made
            # (the SDK's default, parent-based sampling, would make none; this skips its cost as well).
            trace = RequestTrace(None, [(TRACEPARENT, parent)])
            self._remember(key, trace)
            return trace
        context = _parent_context(*ids)
        from opentelemetry.trace import SpanKind

        request = queued.request
        attributes = {
            "gen_ai.operation.name": "chat" if request.messages else "text_completion",
            "gen_ai.request.max_tokens": request.max_new_tokens,
            "messaging.system": "kafka",
            "messaging.destination.name": getattr(queued.partition, "topic", ""),
            "messaging.destination.partition.id": str(getattr(queued.partition, "partition", queued.partition)),
            "messaging.kafka.offset": queued.offset,
            "messaging.message.id": request.id,
            "llm_worker.priority": queued.priority,
            "llm_worker.attempt": queued.attempt,
        }
        if self.model:
            attributes["gen_ai.request.model"] = self.model
        span = self.tracer.start_span("llm.request", context=context, kind=SpanKind.CONSUMER,
                                      start_time=int(queued.timestamp_ms) * 1_000_000, attributes=attributes)
        ctx = span.get_span_context()
        traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}".encode()
        trace = RequestTrace(span, [(TRACEPARENT, traceparent)])
        self._remember(key, trace)
        return trace

    def _remember(self, key: bytes, trace: RequestTrace) -> None:
        self._open[key] = trace
        self._open.move_to_end(key)
        while len(self._open) > MAX_OPEN_TRACES:
            _, oldest = self._open.popitem(last=False)
            if not oldest.ended and oldest.span is not None:
                oldest.span.end()

    # -- its records handed to the producer (publisher.py) ---------------------------------------------------
    def headers_for(self, key: bytes | None, value: bytes):
        """The headers a result record of this key carries; a final ends the request's spans."""
        trace = self._open.get(key)
        if trace is None:
            return None
        if value.startswith(_FINAL_PREFIX) and not trace.ended:
            # Ended once; kept (the oldest forgotten first) while the final may still be built into another
            # batch (a full one, or a retry after a failed send), which must carry the header too.
            trace.ended = True
            self._end(trace, value)
        return trace.headers

    def _end(self, trace: RequestTrace, value: bytes) -> None:
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import Status, StatusCode

        now_ns = time.time_ns()
        span = trace.span
        if span is None:
            return
        if not span.is_recording():  # sampled out by a sampler configured here: nothing to build or export
            span.end(end_time=now_ns)
            return
        try:
            final = _final_decoder.decode(value)
        except msgspec.DecodeError:
            final = None
        if final is not None:
            span.set_attribute("gen_ai.usage.input_tokens", final.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", final.usage.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [final.finish_reason or final.reason])
            span.set_attribute("llm_worker.status", final.status)
            span.set_attribute("llm_worker.reason", final.reason)
            if final.status == "error":
                span.set_status(Status(StatusCode.ERROR, final.reason))
        context = otel_trace.set_span_in_context(span)
        start_ns = span.start_time
        if trace.engine_times is not None:
            arrival, scheduled, first_token, finish = (
                None if t is None else int(t * 1e9) + self._offset_ns for t in trace.engine_times)
            marks = [("queued", start_ns, arrival), ("admitted", arrival, scheduled),
                     ("prefill", scheduled, first_token), ("decode", first_token, finish)]
        else:  # answered without the engine (rejected, shed, invalid): it only waited
            marks = [("queued", start_ns, trace.final_built_ns or now_ns)]
        for name, begin, end in marks:
            if begin is not None and end is not None:
                self.tracer.start_span(name, context=context, start_time=begin).end(end_time=max(begin, end))
        built = trace.final_built_ns or now_ns
        self.tracer.start_span("publish", context=context, start_time=built).end(end_time=max(built, now_ns))
        span.end(end_time=max(now_ns, start_ns or 0))
