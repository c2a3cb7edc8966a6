"""Wire records: round trips, the exported JSON Schema, the exactly-one-prompt rule and every size limit."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import jsonschema
import msgspec
import pytest

from schemas import (
    DEFAULT_LIMITS,
    ChatMessage,
    DeadLetterRecord,
    FinalRecord,
    GenerationRequest,
    Limits,
    PriorityStatus,
    RequestError,
    SamplingSpec,
    StreamChunk,
    Throughput,
    Timings,
    Usage,
    WorkerStatus,
    decode_dead_letter,
    decode_request,
    decode_result,
    decode_status,
    encode,
)
from schemas import export

EXAMPLES_DIR = Path(export.__file__).parent / "examples"
EXAMPLE_PATHS = sorted(EXAMPLES_DIR.glob("*.json"))


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(export.schema_path(export.JSON_DIR, name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def request_bytes(**fields) -> bytes:
    return json.dumps({"id": "r-1", **fields}).encode()


def full_request() -> GenerationRequest:
    return GenerationRequest(
        id="r-1",
        messages=[ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="héllo ✓")],
        max_new_tokens=12,
        sampling=SamplingSpec(temperature=0.5, top_p=0.9, top_k=40, seed=2**63 - 1, stop=["\n"], stop_token_ids=[2]),
        deadline_ms=1_900_000_000_000,
        timeout_ms=5000,
        reply_topic="replies.team-a",
        metadata={"k": "v"},
        priority=2,
        stream=False,
    )


# ---- round trips -------------------------------------------------------------------------------------------


def test_request_round_trip():
    request = full_request()
    assert decode_request(encode(request)) == request


def test_result_union_decodes_each_kind():
    chunk = StreamChunk(id="r-1", attempt=1, seq=3, token_ids=[5, 6], text=" wo")
    final = FinalRecord(
        id="r-1",
        attempt=1,
        status="completed",
        reason="length",
        finish_reason="length",
        usage=Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=0),
        timings=Timings(queue_ms=1.5, ttft_ms=20.0, e2e_ms=40.0, tokens_per_s=50.0),
        text="hello wo",
        token_ids=[5, 6],
        num_chunks=4,
        metadata={"k": "v"},
        worker_id="w-0",
    )
    assert decode_result(encode(chunk)) == chunk
    assert decode_result(encode(final)) == final
    assert json.loads(encode(chunk))["kind"] == "chunk"
    assert json.loads(encode(final))["kind"] == "final"
    with pytest.raises(msgspec.ValidationError):
        decode_result(b'{"kind":"partial","id":"r-1","seq":0}')


def test_status_and_dead_letter_round_trip():
    status = WorkerStatus(
        worker_id="w-0",
        ts_ms=1_700_000_000_000,
        num_waiting=3,
        num_running=2,
        kv_usage=0.25,
        priorities=[PriorityStatus(priority=0, lag=4, num_waiting=1, paused_partitions=[1], shed=True, est_wait_s=0.5)],
        throughput=Throughput(tokens_per_s=100.0, prompt_tokens_per_s=900.0, requests_per_s=2.0),
        shedding=True,
        paused_partitions=[1],
        assigned_partitions=[0, 1, 4],
    )
    assert decode_status(encode(status)) == status
    dead = DeadLetterRecord(
        value=b"\xff\x00not json", key=b"k", error_code="decode_error", error_message="bad", topic="llm.requests",
        partition=2, offset=17, timestamp_ms=1, dead_lettered_ms=2, worker_id="w-0",
    )
    wire = encode(dead)
    assert json.loads(wire)["value"] == "/wBub3QganNvbg=="  # base64, so any bytes survive JSON
    assert decode_dead_letter(wire) == dead


def test_every_record_carries_schema_version():
    records = [
        full_request(),
        StreamChunk(id="a", seq=0),
        FinalRecord(id="a", status="rejected", reason="shed"),
        WorkerStatus(worker_id="w", ts_ms=0),
        DeadLetterRecord(error_code="internal", topic="t", partition=0, offset=0),
    ]
    for record in records:
        assert json.loads(encode(record))["schema_version"] == 1


def test_unknown_fields_are_ignored_and_absent_version_is_one():
    request = decode_request(request_bytes(prompt="hi", added_in_v1_5={"x": [1, 2]}, sampling={"min_p": 0.1}))
    assert isinstance(request, GenerationRequest)
    assert request.schema_version == 1


def test_newer_schema_version_is_refused_with_the_id():
    error = decode_request(request_bytes(prompt="hi", schema_version=2))
    assert error == RequestError("invalid_request", error.message, "r-1")


def test_final_record_must_be_consistent():
    with pytest.raises(ValueError):
        FinalRecord(id="a", status="completed", reason="stop")
    with pytest.raises(ValueError):
        FinalRecord(id="a", status="completed", reason="stop", finish_reason="length")
    with pytest.raises(ValueError):
        FinalRecord(id="a", status="error", reason="internal", finish_reason="stop")
    with pytest.raises(msgspec.ValidationError):
        decode_result(b'{"kind":"final","id":"a","status":"rejected","reason":"shed","finish_reason":"stop"}')


def test_deadline_is_the_earlier_of_absolute_and_relative():
    assert GenerationRequest(id="a", prompt="x").deadline_at_ms(1000) is None
    assert GenerationRequest(id="a", prompt="x", timeout_ms=50).deadline_at_ms(1000) == 1050
    assert GenerationRequest(id="a", prompt="x", deadline_ms=900, timeout_ms=50).deadline_at_ms(1000) == 900
    assert GenerationRequest(id="a", prompt="x", deadline_ms=2000, timeout_ms=50).deadline_at_ms(1000) == 1050


# ---- JSON Schema ----------------------------------------------------------------------------------------------


def test_checked_in_schemas_match_code(tmp_path):
    assert export.stale_schemas() == []
    assert export.run(Namespace(out=export.JSON_DIR, check=True)) == 0
    # --check must notice a difference and a missing file, and writing then fixes it.
    assert export.run(Namespace(out=tmp_path, check=True)) == 1
    assert export.run(Namespace(out=tmp_path, check=False)) == 0
    assert export.run(Namespace(out=tmp_path, check=True)) == 0
    path = export.schema_path(tmp_path, "result")
    path.write_text(path.read_text().replace('"chunk"', '"chunks"'))
    assert export.stale_schemas(tmp_path) == [path]


def test_schema_cli_through_dispatcher():
    from worker.cli import main

    assert main(["schema", "--check"]) == 0


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=lambda p: p.stem)
def test_examples_validate_and_decode(path):
    data = path.read_bytes()
    validator("generation_request").validate(json.loads(data))
    assert isinstance(decode_request(data), GenerationRequest)


def test_there_is_an_example_of_each_prompt_kind():
    kinds = set()
    for path in EXAMPLE_PATHS:
        kinds |= {"prompt", "messages", "prompt_token_ids"} & json.loads(path.read_text()).keys()
    assert kinds == {"prompt", "messages", "prompt_token_ids"}


def test_encoded_records_validate_against_their_schemas():
    # Our own output, nulls included, must satisfy the schema we publish.
    validator("generation_request").validate(json.loads(encode(full_request())))
    validator("generation_request").validate(json.loads(encode(GenerationRequest(id="a", prompt_token_ids=[0]))))
    result = validator("result")
    result.validate(json.loads(encode(StreamChunk(id="a", seq=0, token_ids=[1], text="x"))))
    result.validate(json.loads(encode(FinalRecord(id="a", status="error", reason="internal", message="boom"))))
    validator("worker_status").validate(json.loads(encode(WorkerStatus(worker_id="w", ts_ms=5, kv_usage=1.0))))
    dead = DeadLetterRecord(value=b"\x00", error_code="decode_error", topic="t", partition=0, offset=0)
    validator("dead_letter_record").validate(json.loads(encode(dead)))


def test_schemas_package_imports_no_worker_dependencies():
    code = (
        "import sys, schemas, schemas.export\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'aiokafka', 'worker', 'pydantic')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(export.__file__).parent.parent)


# ---- exactly one prompt ------------------------------------------------------------------------------------------

PROMPTS = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": [1, 2]}
TYPED_PROMPTS = {"prompt": "hi", "messages": [ChatMessage(role="user", content="hi")], "prompt_token_ids": [1, 2]}


@pytest.mark.parametrize(
    "names",
    [(), ("prompt", "messages"), ("prompt", "prompt_token_ids"), ("messages", "prompt_token_ids"), tuple(PROMPTS)],
    ids=lambda names: "+".join(names) or "none",
)
def test_not_exactly_one_prompt_is_refused_by_decoder_and_schema(names):
    fields = {name: PROMPTS[name] for name in names}
    error = decode_request(request_bytes(**fields))
    assert error == RequestError("invalid_request", error.message, "r-1")
    assert "exactly one" in error.message
    assert not validator("generation_request").is_valid({"id": "r-1", **fields})
    with pytest.raises(ValueError):
        GenerationRequest(id="r-1", **{name: TYPED_PROMPTS[name] for name in names})


@pytest.mark.parametrize("name", PROMPTS)
def test_one_prompt_with_explicit_nulls_is_accepted(name):
    fields = {other: None for other in PROMPTS} | {name: PROMPTS[name]}
    assert isinstance(decode_request(request_bytes(**fields)), GenerationRequest)
    assert validator("generation_request").is_valid({"id": "r-1", **fields})


# ---- protocol bounds (in the types, so in the schema too) ---------------------------------------------------------

OK_AND_BAD = [
    ({"sampling": {"temperature": 2.0}}, {"sampling": {"temperature": 2.0000001}}),
    ({"sampling": {"temperature": 0.0}}, {"sampling": {"temperature": -0.1}}),
    ({"sampling": {"top_p": 1.0}}, {"sampling": {"top_p": 1.01}}),
    ({"sampling": {"top_p": 1e-9}}, {"sampling": {"top_p": 0.0}}),
    ({"sampling": {"top_k": 0}}, {"sampling": {"top_k": -1}}),
    ({"sampling": {"seed": 2**63 - 1}}, {"sampling": {"seed": 2**63}}),
    ({"sampling": {"seed": 0}}, {"sampling": {"seed": -1}}),
    ({"sampling": {"stop": ["x"]}}, {"sampling": {"stop": [""]}}),
    ({"max_new_tokens": 1}, {"max_new_tokens": 0}),
    ({"prompt_token_ids": [0, 2**31 - 1]}, {"prompt_token_ids": [0, -1]}),
    ({"prompt_token_ids": [2**31 - 1]}, {"prompt_token_ids": [2**31]}),
    ({"messages": [{"role": "assistant", "content": ""}]}, {"messages": [{"role": "tool", "content": ""}]}),
    ({"messages": [{"role": "user", "content": "x"}]}, {"messages": []}),
    ({"prompt": "x"}, {"prompt": ""}),
    ({"reply_topic": "a.b_c-D9"}, {"reply_topic": "a/b"}),
    ({"timeout_ms": 1}, {"timeout_ms": 0}),
    ({"priority": 255}, {"priority": 256}),
    ({"stream": False}, {"stream": 0}),
    ({"max_new_tokens": 5}, {"max_new_tokens": 5.0}),
    ({"sampling": {"presence_penalty": -2.0}}, {"sampling": {"presence_penalty": -2.01}}),
    ({"sampling": {"frequency_penalty": 2.0}}, {"sampling": {"frequency_penalty": 2.01}}),
    ({"sampling": {"repetition_penalty": 1e-3}}, {"sampling": {"repetition_penalty": 0.0}}),
    ({"sampling": {"min_tokens": 256}}, {"sampling": {"min_tokens": 257}}),  # at most max_new_tokens (256)
    ({"sampling": {"min_tokens": 0}}, {"sampling": {"min_tokens": -1}}),
    ({"sampling": {"logprobs": True, "top_logprobs": 20}}, {"sampling": {"logprobs": True, "top_logprobs": 21}}),
    ({"sampling": {"logprobs": True, "top_logprobs": 0}}, {"sampling": {"top_logprobs": 2}}),  # needs logprobs
]


@pytest.mark.parametrize("ok, bad", OK_AND_BAD, ids=lambda case: json.dumps(case)[:40])
def test_protocol_bounds_on_both_sides(ok, bad):
    def with_prompt(fields):
        return fields if {"prompt", "messages", "prompt_token_ids"} & fields.keys() else {"prompt": "x", **fields}

    assert isinstance(decode_request(request_bytes(**with_prompt(ok))), GenerationRequest)
    error = decode_request(request_bytes(**with_prompt(bad)))
    assert error == RequestError("invalid_request", error.message, "r-1")


@pytest.mark.parametrize("request_id", ["", "has space", "tab\t", "é", "x" * 129])
def test_invalid_ids_are_refused_and_not_echoed(request_id):
    error = decode_request(json.dumps({"id": request_id, "prompt": "x"}).encode())
    assert error == RequestError("invalid_request", error.message, None)


def test_best_effort_request_id():
    assert decode_request(request_bytes(prompt=5)).request_id == "r-1"
    assert decode_request(b'{"prompt": 5}').request_id is None
    assert decode_request(b'{"id": 7, "prompt": "x"}').request_id is None
    # Truncated, so not JSON at all, but the id came whole before the break (tests/test_decode_ids.py has more).
    assert decode_request(b'{"id": "r-1", "prompt": "x"').request_id == "r-1"
    assert decode_request(b'{"prompt": "x", "id": "r-').request_id is None


@pytest.mark.parametrize("data", [None, b"", b"\xff\xfe", b"[]", b"null", "text", b"{" * 100_000])
def test_garbage_is_an_error_value(data):
    error = decode_request(data)
    assert isinstance(error, RequestError)
    assert error.code in ("decode_error", "invalid_request")


def test_buffer_types_are_accepted():
    data = request_bytes(prompt="x")
    assert isinstance(decode_request(bytearray(data)), GenerationRequest)
    assert isinstance(decode_request(memoryview(data)), GenerationRequest)


# ---- deployment limits: each one on both sides of its boundary ---------------------------------------------------

LIMIT_CASES = {
    "max_prompt_chars": (lambda n: {"prompt": "a" * n}, "too_large"),
    "max_messages": (lambda n: {"messages": [{"role": "user", "content": "x"}] * n}, "too_large"),
    "max_prompt_token_ids": (lambda n: {"prompt_token_ids": [1] * n}, "too_large"),
    "max_new_tokens": (lambda n: {"prompt": "x", "max_new_tokens": n}, "invalid_request"),
    "max_stop_strings": (lambda n: {"prompt": "x", "sampling": {"stop": ["s"] * n}}, "invalid_request"),
    "max_stop_chars": (lambda n: {"prompt": "x", "sampling": {"stop": ["ok", "s" * n]}}, "invalid_request"),
    "max_stop_token_ids": (lambda n: {"prompt": "x", "sampling": {"stop_token_ids": [2] * n}}, "invalid_request"),
    "max_metadata_entries": (
        lambda n: {"prompt": "x", "metadata": {f"k{i}": "v" for i in range(n)}},
        "invalid_request",
    ),
    "max_metadata_chars": (lambda n: {"prompt": "x", "metadata": {"k" * n: "v"}}, "invalid_request"),
}


def message_chars(n: int) -> dict:
    # The prompt-chars limit counts all message contents together.
    half = n // 2
    return {"messages": [{"role": "system", "content": "a" * half}, {"role": "user", "content": "b" * (n - half)}]}


def metadata_value_chars(n: int) -> dict:
    return {"prompt": "x", "metadata": {"k": "v" * n}}


@pytest.mark.parametrize(
    "name, build, code",
    [(name, build, code) for name, (build, code) in LIMIT_CASES.items()]
    + [
        ("max_prompt_chars", message_chars, "too_large"),
        ("max_metadata_chars", metadata_value_chars, "invalid_request"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.startswith("max") else "",
)
def test_limit_on_both_sides(name, build, code):
    n = getattr(DEFAULT_LIMITS, name)
    assert isinstance(decode_request(request_bytes(**build(n))), GenerationRequest)
    error = decode_request(request_bytes(**build(n + 1)))
    assert error == RequestError(code, error.message, "r-1"), error


def test_record_bytes_limit_on_both_sides():
    limits = Limits(max_record_bytes=500)
    base = request_bytes(prompt="x")
    fits = base[:-1] + b" " * (500 - len(base)) + b"}"
    assert len(fits) == 500
    assert isinstance(decode_request(fits, limits), GenerationRequest)
    error = decode_request(fits[:-1] + b" }", limits)
    assert error == RequestError("too_large", error.message, "r-1")


def test_id_limit_tightened_by_deployment():
    limits = Limits(max_id_chars=8)
    assert isinstance(decode_request(json.dumps({"id": "a" * 8, "prompt": "x"}).encode(), limits), GenerationRequest)
    error = decode_request(json.dumps({"id": "a" * 9, "prompt": "x"}).encode(), limits)
    assert error == RequestError("invalid_request", error.message, None)


@pytest.mark.parametrize("build", [
    lambda n: {"type": "regex", "regex": "a" * n},
    lambda n: {"type": "grammar", "grammar": "start: " + '"' + "a" * (n - 9) + '"'},
    lambda n: {"type": "json_schema", "json_schema": {"schema": {"enum": ["a" * (n - 13)]}}},  # compact JSON
])
def test_response_format_size_limit_on_both_sides(build):
    limits = Limits(max_response_format_chars=100)
    assert isinstance(decode_request(request_bytes(prompt="x", response_format=build(100)), limits),
                      GenerationRequest)
    error = decode_request(request_bytes(prompt="x", response_format=build(101)), limits)
    assert error == RequestError("too_large", error.message, "r-1")
    assert "101 chars" in error.message and "max_response_format_chars" in error.message


def test_default_limits_are_the_documented_ones():
    assert DEFAULT_LIMITS == Limits(
        max_record_bytes=1024 * 1024, max_prompt_chars=200_000, max_messages=256, max_prompt_token_ids=32_768,
        max_new_tokens=4096, max_stop_strings=8, max_stop_chars=64, max_stop_token_ids=32,
        max_metadata_entries=16, max_metadata_chars=256, max_id_chars=128,
    )


@pytest.mark.parametrize(
    "bad", [{"max_messages": 0}, {"max_new_tokens": -1}, {"max_id_chars": 129}, {"max_stop_chars": 1.5}]
)
def test_limits_reject_nonsense(bad):
    with pytest.raises(ValueError):
        Limits(**bad)


def test_sampling_options_and_logprobs_round_trip():
    from schemas.request import SamplingSpec
    from schemas.result import TokenLogprob, TopLogprob

    sampling = SamplingSpec(min_tokens=3, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                            logprobs=True, top_logprobs=2)
    request = GenerationRequest(id="r-1", prompt="x", max_new_tokens=8, sampling=sampling)
    assert decode_request(encode(request)) == request
    logprobs = [TokenLogprob(token_id=5, logprob=-0.25, top_logprobs=[TopLogprob(token_id=5, logprob=-0.25),
                                                                       TopLogprob(token_id=9, logprob=-2.5)])]
    chunk = StreamChunk(id="r-1", seq=0, token_ids=[5], text="a", logprobs=logprobs)
    final = FinalRecord(id="r-1", status="completed", reason="stop", finish_reason="stop", text="a", token_ids=[5],
                        logprobs=logprobs)
    for record, name in ((chunk, "result"), (final, "result")):
        assert decode_result(encode(record)) == record
        assert validator(name).is_valid(msgspec.json.decode(encode(record)))
    assert decode_result(encode(StreamChunk(id="r-1", seq=0))).logprobs is None


RESPONSE_FORMATS = [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                            "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}},
    {"type": "regex", "regex": "[a-z]+"},
    {"type": "grammar", "grammar": 'start: "yes" | "no"'},
]


@pytest.mark.parametrize("response_format", RESPONSE_FORMATS, ids=lambda f: f["type"])
def test_response_format_round_trips_and_validates(response_format):
    data = request_bytes(prompt="x", response_format=response_format)
    validator("generation_request").validate(json.loads(data))
    request = decode_request(data)
    assert isinstance(request, GenerationRequest) and request.response_format.__struct_config__.tag == \
        response_format["type"]
    assert decode_request(encode(request)) == request
    if response_format["type"] == "json_schema":  # the schema's key order is kept (it orders the output)
        assert list(request.response_format.json_schema.schema["properties"]) == ["b", "a"]


@pytest.mark.parametrize("response_format", [
    {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": []}},
    {"type": "regex", "regex": ""}, {"json_schema": {"schema": {}}}, "json",
])
def test_a_malformed_response_format_is_refused_on_both_sides(response_format):
    data = request_bytes(prompt="x", response_format=response_format)
    assert not validator("generation_request").is_valid(json.loads(data))
    error = decode_request(data)
    assert isinstance(error, RequestError) and error.code == "invalid_request" and error.request_id == "r-1"
    assert "response_format" in error.message
