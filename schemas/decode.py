"""Bytes in, records out. `decode_request` is the worker's one entry point for untrusted input: any bytes at
all give a GenerationRequest or a RequestError, never an exception, so a poison record cannot stop a
partition. The result and status decoders serve clients and raise msgspec.DecodeError instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from schemas.control import ControlRecord
from schemas.dead_letter import DeadLetterRecord
from schemas.id_scan import first_top_level_id
from schemas.limits import DEFAULT_LIMITS, MAX_ID_CHARS, SCHEMA_VERSION, Limits
from schemas.request import ID_PATTERN, GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from schemas.usage import UsageRecord
from schemas.status import WorkerStatus

RequestErrorCode = Literal["decode_error", "invalid_request", "too_large"]


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request record was refused; the worker turns it into an `error` final record when request_id is
    known, and into a dead-letter record otherwise."""

    code: RequestErrorCode
    """decode_error: not JSON (or no value); invalid_request: JSON that breaks the schema or a limit;
    too_large: the record or its prompt exceeds a size limit."""
    message: str
    request_id: str | None = None
    """The record's id when one could be read and is itself valid, so an answer can be keyed by it."""


_ENCODER = msgspec.json.Encoder()
_REQUEST_DECODER = msgspec.json.Decoder(GenerationRequest)
_RESULT_DECODER = msgspec.json.Decoder(StreamChunk | FinalRecord)
_USAGE_DECODER = msgspec.json.Decoder(UsageRecord)
_STATUS_DECODER = msgspec.json.Decoder(WorkerStatus)
_DEAD_LETTER_DECODER = msgspec.json.Decoder(DeadLetterRecord)
_CONTROL_DECODER = msgspec.json.Decoder(ControlRecord)
_ID_RE = re.compile(ID_PATTERN)
_HIGH = r"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
# A high surrogate escape not followed by a low one, or a low one not preceded by a high one. Escaped
# backslashes must be out of the way first, so that every backslash left starts an escape.
_LONE_SURROGATE = re.compile(rf"{_HIGH}(?!{_LOW})|{_LOW}(?<!{_HIGH}{_LOW})")


def encode(record: msgspec.Struct) -> bytes:
    """JSON bytes of any wire record."""
    return _ENCODER.encode(record)


def decode_request(data: bytes | None, limits: Limits = DEFAULT_LIMITS) -> GenerationRequest | RequestError:
    """Decode and check a request record's value. Never raises."""
    if data is None:
        return RequestError("decode_error", "the record has no value (a tombstone)")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return RequestError("decode_error", f"expected bytes, got {type(data).__name__}")
    num_bytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if num_bytes > limits.max_record_bytes:
        return RequestError(
            "too_large",
            f"the record has {num_bytes} bytes, the limit is {limits.max_record_bytes}",
            _find_request_id(data[: limits.max_record_bytes], limits),
        )
    try:
        # JSON is UTF-8 (RFC 8259); msgspec checks only the strings it keeps, so invalid bytes inside an
        # ignored field would pass. Decoding first holds the whole record to it, in C, in one pass.
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        return RequestError("decode_error", f"not UTF-8: {exc}", _find_request_id(data, limits))
    try:
        request = _REQUEST_DECODER.decode(text)
    except msgspec.ValidationError as exc:  # before DecodeError: it is a subclass
        return RequestError("invalid_request", str(exc), _find_request_id(data, limits))
    except msgspec.DecodeError as exc:
        return RequestError("decode_error", _not_json_message(text, exc), _find_request_id(data, limits))
    except RecursionError:
        # msgspec guards its recursion with Python's limit; deep nesting under an ignored field reaches it.
        return RequestError("decode_error", "JSON nested too deeply", _find_request_id(data, limits))
    return check_limits(request, limits) or request


def check_limits(request: GenerationRequest, limits: Limits = DEFAULT_LIMITS) -> RequestError | None:
    """The deployment's size limits and version support; None when the request is within them."""

    def refuse(code: RequestErrorCode, message: str) -> RequestError:
        return RequestError(code, message, request.id if _valid_id(request.id, limits) else None)

    if request.schema_version > SCHEMA_VERSION:
        return refuse("invalid_request", f"schema_version {request.schema_version} is newer than {SCHEMA_VERSION}")
    if len(request.id) > limits.max_id_chars:
        return refuse("invalid_request", f"id has {len(request.id)} chars, the limit is {limits.max_id_chars}")
    if request.num_prompt_chars > limits.max_prompt_chars:
        return refuse(
            "too_large", f"the prompt has {request.num_prompt_chars} chars, the limit is {limits.max_prompt_chars}"
        )
    if request.messages is not None and len(request.messages) > limits.max_messages:
        return refuse("too_large", f"{len(request.messages)} messages, the limit is {limits.max_messages}")
    if request.prompt_token_ids is not None and len(request.prompt_token_ids) > limits.max_prompt_token_ids:
        return refuse(
            "too_large",
            f"{len(request.prompt_token_ids)} prompt token ids, the limit is {limits.max_prompt_token_ids}",
        )
    num_format_chars = request.num_response_format_chars
    if num_format_chars > limits.max_response_format_chars:
        return refuse(
            "too_large",
            f"response_format has {num_format_chars} chars, the limit is {limits.max_response_format_chars} "
            "(max_response_format_chars)",
        )
    if request.tools is not None and len(request.tools) > limits.max_tools:
        return refuse("too_large", f"{len(request.tools)} tools, the limit is {limits.max_tools}")
    num_tools_chars = request.num_tools_chars
    if num_tools_chars > limits.max_tools_chars:
        return refuse("too_large", f"the tools have {num_tools_chars} chars as compact JSON, the limit is "
                      f"{limits.max_tools_chars} (max_tools_chars)")
    if request.max_new_tokens > limits.max_new_tokens:
        return refuse("invalid_request", f"max_new_tokens {request.max_new_tokens} exceeds {limits.max_new_tokens}")
    sampling = request.sampling
    if len(sampling.stop) > limits.max_stop_strings:
        return refuse("invalid_request", f"{len(sampling.stop)} stop strings, the limit is {limits.max_stop_strings}")
    if any(len(s) > limits.max_stop_chars for s in sampling.stop):
        return refuse("invalid_request", f"a stop string exceeds {limits.max_stop_chars} chars")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        return refuse(
            "invalid_request",
            f"{len(sampling.stop_token_ids)} stop token ids, the limit is {limits.max_stop_token_ids}",
        )
    metadata = request.metadata or {}
    if len(metadata) > limits.max_metadata_entries:
        return refuse(
            "invalid_request", f"{len(metadata)} metadata entries, the limit is {limits.max_metadata_entries}"
        )
    if any(len(k) > limits.max_metadata_chars or len(v) > limits.max_metadata_chars for k, v in metadata.items()):
        return refuse("invalid_request", f"a metadata key or value exceeds {limits.max_metadata_chars} chars")
    return None


def decode_result(data: bytes) -> StreamChunk | FinalRecord:
    """Decode a record of the reply topic. Raises msgspec.DecodeError (ValidationError is one) on bad input."""
    return _decode(_RESULT_DECODER, data)


def decode_usage(data: bytes) -> UsageRecord:
    """Decode a usage-topic record. Raises msgspec.DecodeError on bad input."""
    return _decode(_USAGE_DECODER, data)


def decode_status(data: bytes) -> WorkerStatus:
    """Decode a status-topic record. Raises msgspec.DecodeError on bad input."""
    return _decode(_STATUS_DECODER, data)


def decode_dead_letter(data: bytes) -> DeadLetterRecord:
    """Decode a dead-letter record. Raises msgspec.DecodeError on bad input."""
    return _decode(_DEAD_LETTER_DECODER, data)


def decode_control(data: bytes) -> ControlRecord:
    """Decode a control-topic record (a cancel). Raises msgspec.DecodeError on bad input, an unknown kind too."""
    return _decode(_CONTROL_DECODER, data)


def _decode(decoder: msgspec.json.Decoder, data: bytes):
    try:
        return decoder.decode(data)
    except RecursionError as exc:
        raise msgspec.DecodeError("JSON nested too deeply") from exc


def _find_request_id(data: bytes | bytearray | memoryview, limits: Limits) -> str | None:
    # For a record that failed as a whole: an id that is present and valid lets the worker send the sender
    # an error final record instead of leaving it waiting. The scan reads bytes, so bad UTF-8 after the id
    # does not hide it.
    request_id = first_top_level_id(bytes(data))
    return request_id if request_id is not None and _valid_id(request_id, limits) else None


def _not_json_message(text: str, exc: msgspec.DecodeError) -> str:
    # A lone surrogate escape ("\ud800") is legal JSON text but no Unicode string can hold it; msgspec refuses
    # it with a message about truncated input or a hex escape. It is a decode_error, like bytes that are not
    # UTF-8 (the same unencodable text, spelled another way), and like them refused wherever it is, ignored
    # fields included; not an invalid_request, which is for text that decodes but breaks the schema.
    surrogate = _LONE_SURROGATE.search(text.replace("\\\\", "__")) if "\\u" in text else None
    if surrogate is not None:
        return f"not valid JSON text: a string holds a lone surrogate escape ({surrogate.group()}), not Unicode"
    return f"not valid JSON: {exc}"


def _valid_id(request_id: str, limits: Limits) -> bool:
    return 1 <= len(request_id) <= min(limits.max_id_chars, MAX_ID_CHARS) and _ID_RE.match(request_id) is not None
