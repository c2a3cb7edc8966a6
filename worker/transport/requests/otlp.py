"""OTLP/HTTP span export with the spans written to protobuf wire bytes directly.

The SDK's OTLP encoder builds a protobuf object for every span, attribute and value, and hashes each span's
resource (a JSON dump of its attributes) to group spans: about 17 us a span, 100 us for a traced request's six,
more than the whole Kafka path of a request. Written out by hand, with the resource and scope encoded once, a
span costs a few microseconds. The bytes are the same message: tests/transport/test_tracing.py decodes them
with the generated protobuf classes and compares them with the SDK's encoding of the same spans.

Spans with events or links (none of the worker's have them; another library's spans in this process might)
go through the SDK's encoder and are appended as a further ResourceSpans: serialised protobuf messages
concatenate, and the repeated field then holds both.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http._common import _is_request_too_large
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

log = logging.getLogger(__name__)

_SMALL = [bytes([i]) for i in range(128)]
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # opentelemetry.proto.trace.v1.SpanFlags
_FLAGS = {False: b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE),  # field 16, fixed32
          True: b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE)}
_keys: dict[str, bytes] = {}
"""Attribute key -> its KeyValue.key field, encoded: the worker's keys are a fixed few."""


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _any_value(value) -> bytes:
    """An AnyValue message, with the SDK encoder's order of type tests (bool before int)."""
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value if value >= 0 else value + (1 << 64))
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence) and not isinstance(value, Mapping):
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any_value(v)) for v in value]))
    raise TypeError(type(value))  # None, mappings: left to the SDK's encoder


def _attributes(attributes) -> bytes:
    out = []
    for key, value in attributes.items():
        encoded_key = _keys.get(key)
        if encoded_key is None:
            encoded_key = _field(b"\x0a", key.encode())
            if len(_keys) < 1024:
                _keys[key] = encoded_key
        out.append(_field(b"\x4a", encoded_key + _field(b"\x12", _any_value(value))))
    return b"".join(out)


def encode_span(span) -> bytes:
    """One opentelemetry.proto.trace.v1.Span; TypeError for what only the SDK's encoder handles."""
    if span.events or span.links:
        raise TypeError("events or links")
    context, parent = span.context, span.parent
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
    if context.trace_state:
        parts.append(_field(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items()).encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    parts += (_field(b"\x2a", span.name.encode()), b"\x30", _SMALL[span.kind.value + 1],
              b"\x39", struct.pack("<Q", span.start_time), b"\x41", struct.pack("<Q", span.end_time))
    if span.attributes:
        parts.append(_attributes(span.attributes))
    for tag, count in ((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                       (b"\x70", span.dropped_links)):
        if count:
            parts += (tag, _varint(count))
    status = span.status
    code, description = status.status_code.value, status.description
    parts.append(_field(b"\x7a", (_field(b"\x12", description.encode()) if description else b"")
                        + (b"\x18" + _SMALL[code] if code else b"")))
    parts.append(_FLAGS[bool(parent is not None and parent.is_remote)])
    return b"".join(parts)


class _Envelopes:
    """The ResourceSpans and ScopeSpans around spans of one resource and scope, encoded once for each."""

    def __init__(self) -> None:
        self._resources: dict[int, tuple[object, bytes, bytes]] = {}
        self._scopes: dict[int, tuple[object, bytes, bytes]] = {}

    def resource(self, resource) -> tuple[bytes, bytes]:
        cached = self._resources.get(id(resource))
        if cached is None or cached[0] is not resource:
            head = _field(b"\x0a", _encode_resource(resource).SerializeToString())
            tail = _field(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b""
            cached = self._resources[id(resource)] = (resource, head, tail)
        return cached[1], cached[2]

    def scope(self, scope) -> tuple[bytes, bytes]:
        cached = self._scopes.get(id(scope))
        if cached is None or cached[0] is not scope:
            head = _field(b"\x0a", _encode_instrumentation_scope(scope).SerializeToString())
            schema_url = scope.schema_url if scope is not None else ""
            tail = _field(b"\x1a", schema_url.encode()) if schema_url else b""
            cached = self._scopes[id(scope)] = (scope, head, tail)
        return cached[1], cached[2]


def encode_request(spans, envelopes: _Envelopes | None = None) -> bytes:
    """An ExportTraceServiceRequest holding `spans`, serialised."""
    envelopes = envelopes or _Envelopes()
    groups: dict[tuple[int, int], tuple[object, object, list[bytes]]] = {}
    others = []
    for span in spans:
        try:
            encoded = encode_span(span)
        except TypeError:
            others.append(span)
            continue
        resource, scope = span.resource, span.instrumentation_scope or None
        group = groups.get((id(resource), id(scope)))
        if group is None:
            group = groups[(id(resource), id(scope))] = (resource, scope, [])
        group[2].append(_field(b"\x12", encoded))
    by_resource: dict[int, tuple[object, list[bytes]]] = {}
    for resource, scope, encoded_spans in groups.values():
        scope_head, scope_tail = envelopes.scope(scope)
        scope_spans = _field(b"\x12", scope_head + b"".join(encoded_spans) + scope_tail)
        by_resource.setdefault(id(resource), (resource, []))[1].append(scope_spans)
    out = []
    for resource, scope_spans in by_resource.values():
        head, tail = envelopes.resource(resource)
        out.append(_field(b"\x0a", head + b"".join(scope_spans) + tail))
    if others:
        out.append(encode_spans(others).SerializePartialToString())
    return b"".join(out)


class FastOTLPSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (its endpoint, headers, retries and settings from the same variables),
    with encode_request in place of the SDK's encoder."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._envelopes = _Envelopes()

    def export(self, spans) -> SpanExportResult:
        if self._shutdown:
            return super().export(spans)  # logs and fails as the SDK's does
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = encode_request(spans, self._envelopes)
            except Exception as error:  # noqa: BLE001 - an export must fail, never raise into the SDK's thread
                log.error("failed to encode a span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if _is_request_too_large(data, self._max_request_size):
                log.warning("dropping a span batch of %d bytes, over the %d-byte request limit", len(data),
                            self._max_request_size)
                return SpanExportResult.FAILURE
            outcome = self._client.export(data)
            if not outcome.success:
                result.error = outcome.error
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
