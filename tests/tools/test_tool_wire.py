"""The wire's tool fields: what the decoder accepts and what it refuses (a typed error, as every invalid
request), and the JSON Schemas' view of them."""

from __future__ import annotations

import msgspec
import pytest

from schemas.decode import RequestError, decode_request, encode
from schemas.limits import Limits
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from schemas.tools import FunctionCall, ToolCall, ToolCallDelta, parameters_problem, schema_problem

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def request(**fields) -> bytes:
    body = {"id": "r1", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return msgspec.json.encode(body)


def refused(data: bytes, limits: Limits = Limits()) -> RequestError:
    decoded = decode_request(data, limits)
    assert isinstance(decoded, RequestError), decoded
    assert decoded.request_id == "r1"
    return decoded


def test_a_tools_request_and_a_conversation_with_calls_and_results_decode():
    data = request(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False, messages=[
                       {"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    decoded = decode_request(data)
    assert isinstance(decoded, GenerationRequest)
    assert decoded.forces_tool_call and decoded.effective_tool_choice.function.name == "get_weather"
    assert decoded.messages[1].tool_calls[0].function.arguments == '{"city": "Paris"}'
    chars = ("Weather in Paris?", "get_weather", '{"city": "Paris"}', "18 C, sunny")
    assert decoded.num_prompt_chars == sum(map(len, chars))
    assert decode_request(encode(decoded)) == decoded
    auto = decode_request(request(tools=[WEATHER]))
    assert auto.effective_tool_choice == "auto" and not auto.forces_tool_call
    assert decode_request(request()).effective_tool_choice == "none"


@pytest.mark.parametrize("fields, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "parameters must describe the arguments object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "parameters.properties.x.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"anyOf": []}}}}}]}, "anyOf must be a non-empty list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]},
     "required must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "Expected `object | null`, got `str`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice names 'get_time', which is not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tool names must be unique: get_weather"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "matching regex"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "Invalid enum value 'sometimes'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "a tool message needs tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "a user message needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "only an assistant message has tool_calls"),
])
def test_bad_tools_are_invalid_requests(fields, words):
    error = refused(request(**fields))
    assert error.code == "invalid_request" and words in error.message, error.message


def test_tools_need_a_chat_request():
    data = msgspec.json.encode({"id": "r1", "prompt": "x", "tools": [WEATHER]})
    assert "tools need messages" in refused(data).message


def test_tool_limits_are_too_large():
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(4)]
    assert refused(request(tools=many), Limits(max_tools=3)).code == "too_large"
    error = refused(request(tools=[WEATHER]), Limits(max_tools_chars=50))
    assert error.code == "too_large" and "max_tools_chars" in error.message


def test_schema_problem_reads_shapes_and_bounds_depth():
    assert schema_problem(True) is None and schema_problem({}) is None
    assert schema_problem({"type": ["string", "null"], "minLength": 1, "enum": ["a", None]}) is None
    assert "minLength" in schema_problem({"minLength": -1})
    assert "pattern" in schema_problem({"pattern": 3})
    assert "$defs.a" in schema_problem({"$defs": {"a": 5}})
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    assert "deeper than" in parameters_problem(deep)


def test_results_carry_tool_calls_and_the_finish_reason():
    call = ToolCall(id="call_abc", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    final = FinalRecord(id="r1", status="completed", reason="tool_calls", finish_reason="tool_calls",
                        text='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                        content="", tool_calls=[call])
    assert msgspec.json.decode(encode(final), type=FinalRecord) == final
    chunk = StreamChunk(id="r1", seq=0, text="<tool_call>", content="",
                        tool_calls=[ToolCallDelta(index=0, id="call_abc", name="get_weather")])
    assert msgspec.json.decode(encode(chunk), type=StreamChunk) == chunk
