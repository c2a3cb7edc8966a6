"""OpenTelemetry traces through Kafka headers: a request record's W3C `traceparent` header continues into the
worker's spans, and the request's result records carry the trace on in their headers.

Per sampled request (its record's `traceparent` has the sampled flag), one `llm.request` span (kind CONSUMER,
from the record's timestamp to its final record being handed to the producer), child of the producer's span,
with children built from the timings the engine reports (RequestOutput), never inside the engine:

    queued   record timestamp -> handed to the engine (Kafka and the local queue)
    admitted handed to the engine -> first scheduled (waiting inside the engine)
    prefill  first scheduled -> first token
    decode   first token -> last token
    publish  final record built -> handed to the producer

and `gen_ai.*` attributes (operation, model, max tokens, input and output tokens, finish reason). Chunks and
finals get a `traceparent` header naming the `llm.request` span (same trace id as the producer's). A record
whose trace the producer did not sample has its header carried on unchanged onto its results, and nothing else.

What a request costs is the point of the design, since every record of the Kafka path passes here:

- unsampled (the usual case at any realistic sampling rate): one scan of the record's headers, a suffix test,
  and the header's bytes kept under the record's key (bytes: nothing for the garbage collector to walk); no
  object of the SDK, no parsing, no context;
- sampled: all six spans are built at once when the final passes, as finished `ReadableSpan`s handed to the
  tracer's span processors. The SDK's live spans (a lock, bounded attribute and event containers, a context and
  a sampler call each) cost about 25 us apiece, and none of that is needed for spans whose times are all known
  when they are made. The provider's sampler is still asked once, for the request span.

On only when the OpenTelemetry SDK is installed (the `otel` extra) and configured: the SDK's own variables
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_TRACES_EXPORTER=otlp`; OTLP over HTTP, encoded by otlp.py) or a tracer
provider set by the embedding program (as the tests do). Off, nothing is imported and the hot paths test one
attribute.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

import msgspec

from schemas.result import FinalRecord
from worker.memory import freeze_startup_objects

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
OTEL_ENV = ("OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
            "OTEL_RESOURCE_ATTRIBUTES")
"""The SDK's variables a deployment may set (deploy/worker.yaml names some; tests/test_deploy.py checks them)."""
MAX_OPEN_TRACES = 20_000
"""Traced requests remembered (their header, and for a sampled one its trace); past it the oldest are
forgotten, and a sampled one's spans are ended then if its final never passed the publisher (one sent on
another path must not be held forever)."""
_FINAL_PREFIX = b'{"kind":"final"'
"""msgspec writes the tag field first: a result record starting so is a final."""
_UNSAMPLED_SUFFIX = b"-00"
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


def _epoch_offset_ns() -> int:
    """Add to time.monotonic() * 1e9 to get epoch nanoseconds (the engine's timings are monotonic)."""
    return time.time_ns() - time.monotonic_ns()


class RequestTrace:
    """One sampled request: the ids of its span, the header its result records carry, what its attributes are
    made of, and the engine's timings."""

    __slots__ = ("trace_id", "parent_id", "span_id", "start_ns", "queued", "headers", "engine_times",
                 "final_built_ns", "ended")

    def __init__(self, trace_id: int, parent_id: int, span_id: int, start_ns: int, queued) -> None:
        self.trace_id, self.parent_id, self.span_id, self.start_ns = trace_id, parent_id, span_id, start_ns
        self.queued = queued
        self.headers = [(TRACEPARENT, f"00-{trace_id:032x}-{span_id:016x}-01".encode())]
        self.engine_times: tuple | None = None
        """(arrival, first scheduled, first token, finish), monotonic seconds, from the engine's last output."""
        self.final_built_ns: int | None = None
        self.ended = False

    def engine_done(self, out) -> None:
        """The engine's final output for the request (streamer.py): keep its timings for the child spans."""
        self.engine_times = (out.arrival_time, out.first_scheduled_time, out.first_token_time, out.finish_time)
        self.final_built_ns = time.time_ns()


class NoTracing:
    """Tracing off: no request starts a trace and no record carries headers (the publisher's `headers_for`)."""

    headers_for = None

    def begin(self, headers, key: bytes, queued) -> None:
        return None


class RequestTracing:
    """`tracer`: the OpenTelemetry SDK's Tracer (its sampler, id generator, resource, scope and span processors
    are used directly)."""

    def __init__(self, tracer, model: str = "") -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            set_span_in_context,
        )

        self.tracer = tracer
        self.model = model
        self._open: OrderedDict = OrderedDict()
        self._offset_ns = _epoch_offset_ns()
        self._readable, self._context_of, self._kind = ReadableSpan, SpanContext, SpanKind.CONSUMER
        self._sampled_flags = TraceFlags(TraceFlags.SAMPLED)
        self._error = lambda reason: Status(StatusCode.ERROR, reason)
        self._unset = Status(StatusCode.UNSET)
        self._parent_context = lambda ctx: set_span_in_context(NonRecordingSpan(ctx))

    @classmethod
    def from_env(cls, model: str = "") -> "RequestTracing | NoTracing":
        """The tracing of this process, or NoTracing when it is off (no SDK, or nothing configured)."""
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError:
            return NoTracing()
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or os.environ.get("OTEL_TRACES_EXPORTER") == "otlp"):
                return NoTracing()
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            from worker.transport.requests.otlp import FastOTLPSpanExporter

            provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get(
                "OTEL_SERVICE_NAME", "llm-worker")}))
            provider.add_span_processor(BatchSpanProcessor(FastOTLPSpanExporter()))
            trace.set_tracer_provider(provider)
            log.info("tracing: OTLP export to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the default"))
        tracing = cls(provider.get_tracer("kafka-llm-worker"), model)
        # The SDK, its exporter and their imports (protobuf, requests) are tens of thousands of objects that
        # live as long as the process: out of the collector's sight, as the engine's start-up objects are, so
        # that full collections do not walk them again and again.
        freeze_startup_objects()
        return tracing

    # -- a request record read ------------------------------------------------------------------------------
    def begin(self, headers, key: bytes, queued) -> RequestTrace | None:
        """A request record was read. Its traceparent, if any, is kept for its results; a RequestTrace comes
        back only when the trace is sampled (spans are recorded for it), None otherwise."""
        for name, value in headers or ():
            if name == TRACEPARENT:
                break
        else:
            return None
        if value.endswith(_UNSAMPLED_SUFFIX) and len(value) == 55:
            # Not sampled by the producer, the usual case: carried on as it came, nothing recorded (the SDK's
            # default parent-based sampling would record nothing either). Its ids are never looked at.
            self._remember(key, value)
            return None
        ids = _parse(value)
        if ids is None:
            return None
        trace_id, parent_id, flags = ids
        if not flags & 0x01:
            self._remember(key, value)
            return None
        tracer = self.tracer
        span_id = tracer.id_generator.generate_span_id()
        parent = self._context_of(trace_id, parent_id, is_remote=True, trace_flags=self._sampled_flags)
        decision = tracer.sampler.should_sample(self._parent_context(parent), trace_id, "llm.request", self._kind)
        if not decision.decision.is_sampled():
            # A sampler configured here drops what the producer sampled: results name a span of ours, unsampled.
            self._remember(key, f"00-{trace_id:032x}-{span_id:016x}-00".encode())
            return None
        trace = RequestTrace(trace_id, parent_id, span_id, int(queued.timestamp_ms) * 1_000_000, queued)
        self._remember(key, trace)
        return trace

    def _remember(self, key: bytes, entry) -> None:
        self._open[key] = entry
        if len(self._open) > MAX_OPEN_TRACES:
            _, oldest = self._open.popitem(last=False)
            if oldest.__class__ is RequestTrace and not oldest.ended:
                oldest.ended = True
                self._end(oldest, None)

    # -- its records handed to the producer (publisher.py) ---------------------------------------------------
    def headers_for(self, key: bytes | None, value: bytes):
        """The headers a result record of this key carries; a final ends a sampled request's spans."""
        entry = self._open.get(key)
        if entry is None:
            return None
        if entry.__class__ is bytes:
            return [(TRACEPARENT, entry)]
        if not entry.ended and value.startswith(_FINAL_PREFIX):
            # Ended once; kept (the oldest forgotten first) while the final may still be built into another
            # batch (a full one, or a retry after a failed send), which must carry the header too.
            entry.ended = True
            self._end(entry, value)
        return entry.headers

    def _end(self, trace: RequestTrace, value: bytes | None) -> None:
        """Build the request's spans, all finished, and hand them to the span processors."""
        now_ns = time.time_ns()
        tracer, readable, context_of, flags = self.tracer, self._readable, self._context_of, self._sampled_flags
        resource, scope = tracer.resource, tracer._instrumentation_scope
        try:
            final = _final_decoder.decode(value) if value is not None else None
        except msgspec.DecodeError:
            final = None
        queued = trace.queued
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
        status = self._unset
        if final is not None:
            attributes["gen_ai.usage.input_tokens"] = final.usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = final.usage.completion_tokens
            attributes["gen_ai.response.finish_reasons"] = (final.finish_reason or final.reason,)
            attributes["llm_worker.status"] = final.status
            attributes["llm_worker.reason"] = final.reason
            if final.status == "error":
                status = self._error(final.reason)
        trace.queued = None  # the request is answered: its trace need not hold it any longer
        trace_id, start_ns = trace.trace_id, trace.start_ns
        root = context_of(trace_id, trace.span_id, is_remote=False, trace_flags=flags)
        parent = context_of(trace_id, trace.parent_id, is_remote=True, trace_flags=flags)
        spans = [readable("llm.request", root, parent, resource, attributes, kind=self._kind,
                          instrumentation_scope=scope, status=status, start_time=start_ns,
                          end_time=max(now_ns, start_ns))]
        built = trace.final_built_ns or now_ns
        if trace.engine_times is not None:
            arrival, scheduled, first_token, finish = (
                None if t is None else int(t * 1e9) + self._offset_ns for t in trace.engine_times)
            marks = (("queued", start_ns, arrival), ("admitted", arrival, scheduled),
                     ("prefill", scheduled, first_token), ("decode", first_token, finish), ("publish", built, now_ns))
        else:  # answered without the engine (rejected, shed, invalid): it only waited
            marks = (("queued", start_ns, built), ("publish", built, now_ns))
        new_span_id = tracer.id_generator.generate_span_id
        for name, begin, end in marks:
            if begin is not None and end is not None:
                spans.append(readable(name, context_of(trace_id, new_span_id(), is_remote=False, trace_flags=flags),
                                      root, resource, instrumentation_scope=scope, start_time=begin,
                                      end_time=max(begin, end)))
        processor = tracer.span_processor
        for span in spans:
            processor.on_end(span)
