"""Property tests of decode_request, the worker's entry point for untrusted bytes: whatever arrives, the
answer is a GenerationRequest within limits or a RequestError, never an exception."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    DEFAULT_LIMITS,
    ChatMessage,
    GenerationRequest,
    RequestError,
    SamplingSpec,
    check_limits,
    decode_request,
    encode,
)
from schemas import export
from schemas.limits import MAX_ID_CHARS
from schemas.request import (ID_PATTERN, GrammarFormat, JsonObjectFormat, JsonSchemaFormat, JsonSchemaSpec,
                             RegexFormat, TextFormat)

pytestmark = pytest.mark.slow  # ~5 s of hypothesis examples: in the full suite, not the fast subset

# Drawing a whole request costs hypothesis ~7 ms, so the request-based properties run fewer examples to keep the
# schemas suite under 10 s; raw bytes are cheap.
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_REQUESTS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=128)
texts = st.text(max_size=20)
token_ids = st.integers(0, 2**31 - 1)
ms = st.integers(0, 2**53 - 1)
TOPIC_CHARS = "abcXYZ019._-"

samplings = st.builds(
    SamplingSpec,
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, 2**31 - 1),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=12), max_size=3),
    stop_token_ids=st.lists(token_ids, max_size=4),
    ignore_eos=st.booleans(),
)
messages = st.lists(
    st.builds(ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=texts), min_size=1, max_size=3
)
prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}),
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(token_ids, min_size=1, max_size=12)}),
)
metadata = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
response_formats = st.none() | st.sampled_from([
    TextFormat(), JsonObjectFormat(), RegexFormat(regex="[a-z]+"), GrammarFormat(grammar='start: "a"'),
    JsonSchemaFormat(json_schema=JsonSchemaSpec(schema={"type": "object", "properties": {"a": {"enum": [1, "x"]}}})),
])


@st.composite
def valid_requests(draw) -> GenerationRequest:
    return GenerationRequest(
        id=draw(ids),
        **draw(prompts),
        max_new_tokens=draw(st.integers(1, DEFAULT_LIMITS.max_new_tokens)),
        sampling=draw(samplings),
        response_format=draw(response_formats),
        deadline_ms=draw(st.none() | ms),
        timeout_ms=draw(st.none() | st.integers(1, 2**53 - 1)),
        reply_topic=draw(st.none() | st.text(TOPIC_CHARS, min_size=1, max_size=20)),
        metadata=draw(metadata),
        priority=draw(st.none() | st.integers(0, 255)),
        stream=draw(st.booleans()),
    )


# Values that stress a decoder: wrong types, huge and non-finite numbers, deep nesting, odd strings.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**70),
    st.integers(max_value=-(2**63) + 2, min_value=-(2**70)),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.just("x" * 300),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@functools.cache
def request_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(export.schema_path(export.JSON_DIR, "generation_request").read_text())
    return jsonschema.Draft202012Validator(schema)


def assert_decodes_to_a_value(data: bytes, check_schema: bool = True) -> GenerationRequest | RequestError:
    result = decode_request(data)  # an exception here fails the test
    assert isinstance(result, (GenerationRequest, RequestError))
    if isinstance(result, GenerationRequest):
        assert check_limits(result) is None
        assert decode_request(encode(result)) == result
        if check_schema:
            # Whatever the decoder accepts, the published schema accepts too.
            request_validator().validate(json.loads(data))
    else:
        assert result.code in ("decode_error", "invalid_request", "too_large")
        # An id is only handed back when it is itself valid, since the worker will key an answer by it.
        assert result.request_id is None or (
            len(result.request_id) <= MAX_ID_CHARS and re.fullmatch(ID_PATTERN, result.request_id)
        )
    return result


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    assert_decodes_to_a_value(data)


@FUZZ_REQUESTS
@given(valid_requests())
def test_valid_requests_round_trip(request):
    data = encode(request)
    assert decode_request(data) == request
    request_validator().validate(json.loads(data))


@FUZZ_REQUESTS
@given(valid_requests(), st.data())
def test_byte_flips_truncation_and_insertion(request, data):
    wire = bytearray(encode(request))
    mutation = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    i = data.draw(st.integers(0, len(wire) - 1))
    if mutation == "flip":
        wire[i] ^= data.draw(st.integers(1, 255))
    elif mutation == "truncate":
        del wire[i:]
    elif mutation == "insert":
        wire[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        del wire[i : i + data.draw(st.integers(1, 8))]
    assert_decodes_to_a_value(bytes(wire))


@FUZZ_REQUESTS
@given(valid_requests(), st.data())
def test_field_type_swaps_and_huge_values(request, data):
    obj = json.loads(encode(request))
    # Replace or add a top-level field, or a sampling field, with an arbitrary JSON value.
    target = obj["sampling"] if data.draw(st.booleans()) else obj
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=10))
    target[key] = data.draw(json_values)
    result = assert_decodes_to_a_value(json.dumps(obj).encode())
    if isinstance(result, RequestError) and not (target is obj and key == "id"):
        # The id was untouched, so the error can still be answered under it.
        assert result.request_id == request.id


# Bytes after the id that look like JSON: brackets, strings, escapes (surrogates too), literals. No `i`, nor
# the digits of \u0069, so they never spell a second "id" key.
JSONISH = "[]{}\",:\\ud0ab8c1-.etrnalsf \n"
id_suffixes = st.binary(max_size=200) | st.text(JSONISH, max_size=200).map(str.encode)


@FUZZ
@given(ids, id_suffixes)
def test_whatever_follows_a_valid_id_an_error_carries_it(request_id, suffix):
    result = assert_decodes_to_a_value(b'{"id":%s,' % json.dumps(request_id).encode() + suffix, check_schema=False)
    if isinstance(result, RequestError):
        assert result.request_id is not None, result
        if not re.search(rb'"id"|\\u00', suffix):
            # Only a suffix could hold a second id, which a record decoded whole answers under (msgspec keeps
            # the last); a broken one, under the first.
            assert result.request_id == request_id, result


@settings(max_examples=60, deadline=None)
@given(
    st.integers(500, 20_000),
    st.sampled_from(["[", "{\"a\":", "[{\"x\":"]),
    st.sampled_from(["prompt", "zz", "sampling"]),
)
def test_deep_nesting(depth, opener, field):
    closer = {"[": "]", "{\"a\":": "}", "[{\"x\":": "}]"}[opener]
    nested = opener * depth + "1" + closer * depth
    data = ('{"id":"r-1","prompt_token_ids":[1],"%s":%s}' % (field, nested)).encode()
    # msgspec skips an ignored field deeper than Python's json module can parse, so no schema check here.
    assert_decodes_to_a_value(data, check_schema=False)
    assert_decodes_to_a_value(nested.encode(), check_schema=False)


NUMERIC_FIELDS = ['"max_new_tokens":%s', '"timeout_ms":%s', '"sampling":{"temperature":%s}', '"sampling":{"seed":%s}']


def test_non_finite_and_out_of_range_numbers():
    for literal in ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 400, "-" + "9" * 400]:
        for field in NUMERIC_FIELDS:
            data = ('{"id":"r-1","prompt":"x",%s}' % (field % literal)).encode()
            assert isinstance(assert_decodes_to_a_value(data), RequestError)
