"""Tool calling through the official `openai` package, a real broker, a real worker (the tiny random Llama: a
forced call's grammar makes its output a valid call whatever the weights) and the gateway; and the same calls
for a producer that writes the wire record to Kafka itself."""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import openai
import pytest

from tests.client.helpers import read_topic
from tests.gateway.test_gateway_kafka import MODEL, stack  # noqa: F401 (a fixture)
from tests.transport.kafka_helpers import Collector, produce

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
               "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": WEATHER_PARAMS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


async def test_a_named_call_validates_and_streams_to_the_same_call(stack):  # noqa: F811
    _, _, gateway = stack
    client = gateway.client()
    answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice=NAMED, temperature=0, max_tokens=96)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)

    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice=NAMED, temperature=0, max_tokens=96, stream=True)
    calls: dict[int, dict] = {}
    finish = []
    async for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert entry["id"] is None and piece.function.name
                entry.update(id=piece.id, name=piece.function.name)
            entry["arguments"] += piece.function.arguments or ""
        assert not chunk.choices[0].delta.content
        finish.append(chunk.choices[0].finish_reason)
    assert finish[-1] == "tool_calls" and list(calls) == [0]
    # Greedy: the same call (ids are drawn per answer).
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
    assert calls[0]["id"].startswith("call_")


async def test_required_with_two_tools_then_a_second_turn_with_the_result(stack):  # noqa: F811
    _, _, gateway = stack
    client = gateway.client()
    first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                 tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                 max_tokens=96)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    [call] = message.tool_calls
    assert call.function.name in SCHEMAS
    check_call(call)

    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    second = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK],
                                                  tool_choice="none", temperature=0, max_tokens=6)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    # The call and its result are rendered into the prompt: each turn of the history adds to it (tool_choice none
    # shows no tools in any of the three).
    prompts = []
    for turns in (history[:1], history[:2]):
        shorter = await client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER, CLOCK],
                                                       tool_choice="none", temperature=0, max_tokens=1)
        prompts.append(shorter.usage.prompt_tokens)
    call_tokens = len(call.function.arguments) // 4
    assert prompts[0] + call_tokens < prompts[1] < second.usage.prompt_tokens


async def test_bad_tools_get_openai_errors_and_nothing_reaches_kafka(stack):  # noqa: F811
    kafka, _, gateway = stack
    client = gateway.client()
    before = len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2))
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad_schema])
    assert info.value.param == "tools" and "parameters.properties.x.type" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                             tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert info.value.param == "tool_choice" and info.value.code == "invalid_request"
    assert len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2)) == before


async def test_a_producer_on_the_wire_gets_the_calls_in_the_final(stack):  # noqa: F811
    kafka, _, _ = stack
    good, bad, kept = (f"tools-{what}-{uuid.uuid4().hex[:8]}" for what in ("good", "bad", "unkept"))
    # Written by hand, as a producer in another language would.
    record = {"id": good, "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": NAMED, "max_new_tokens": 96,
              "stream": True}
    refused = {"id": bad, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                "function": {"name": "nope"}}}
    # A schema of the right shape that the grammar library cannot keep (`not`): refused when its grammar compiles.
    unkept = {"id": kept, "messages": ASK, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}
    async with Collector(kafka) as collector:
        await produce(kafka, [(1, json.dumps(body).encode(), body["id"]) for body in (record, refused, unkept)])
        await collector.wait_until(lambda r: all(r.finals.get(i) for i in (good, bad, kept))
                                   and any(d.request_id == bad for d in r.dead_letters), 60, "finals, dead letter")
    final = collector.results.finals[good][0]
    assert (final.status, final.finish_reason, final.content) == ("completed", "tool_calls", "")
    [call] = final.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert final.text.startswith("<tool_call>\n") and final.text.endswith("\n</tool_call>")
    chunks = collector.results.chunks[(good, final.attempt)]
    pieces = [p for c in chunks for p in c.tool_calls or ()]
    assert pieces[0].id == call.id and "".join(p.arguments for p in pieces) == call.function.arguments
    error = collector.results.finals[bad][0]
    assert (error.status, error.reason) == ("error", "invalid_request") and "tool_choice names" in error.message
    # Refused at decode, it is set aside as every invalid record is; the one refused at compile decoded fine.
    [dead] = [d for d in collector.results.dead_letters if d.request_id == bad]
    assert dead.error_code == "invalid_request" and json.loads(dead.value) == refused
    assert not any(d.request_id == kept for d in collector.results.dead_letters)
    error = collector.results.finals[kept][0]
    assert (error.status, error.reason) == ("error", "invalid_request") and error.message.startswith("tools: ")


RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER_PARAMS}


async def test_the_responses_api_calls_a_function_streams_it_and_takes_its_output(stack):  # noqa: F811
    """The same forced call through `client.responses`: a function_call output item whose arguments validate,
    the streamed events carrying the same arguments, and a second turn with the call and its output."""
    _, _, gateway = stack
    client = gateway.client()
    answer = await client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                           tools=[RESPONSES_WEATHER], temperature=0, max_output_tokens=96,
                                           tool_choice={"type": "function", "name": "get_weather"})
    assert answer.status == "completed"
    [call] = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert answer.tools[0].name == "get_weather"

    stream = await client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                           tools=[RESPONSES_WEATHER], temperature=0, max_output_tokens=96,
                                           tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    events = [event async for event in stream]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments  # greedy: the same call
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"

    second = await client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=8, tools=[RESPONSES_WEATHER], tool_choice="none",
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    alone = await client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, tools=[RESPONSES_WEATHER],
                                          tool_choice="none", input="What is the weather in Paris?")
    assert second.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output were in the prompt

    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert refused.value.code == "unsupported_parameter"


async def test_n_2_forced_calls_each_validate_plain_and_streamed(stack):  # noqa: F811
    """Two sampled completions of a forced call: each choice its own call, its own id, valid arguments; streamed,
    each choice's pieces assemble to a call of its own index."""
    _, _, gateway = stack
    client = gateway.client()
    answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", n=2, temperature=1.0, seed=7,
                                                  max_tokens=96)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    ids = set()
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
            ids.add(call.id)
    assert len(ids) == sum(len(c.message.tool_calls) for c in answer.choices)

    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice=NAMED, n=2, temperature=1.0, seed=7, max_tokens=96,
                                                  stream=True)
    calls: dict[tuple[int, int], dict] = {}
    finish: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                entry = calls.setdefault((choice.index, piece.index), {"id": None, "name": None, "arguments": ""})
                if piece.id is not None:
                    entry.update(id=piece.id, name=piece.function.name)
                entry["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [(0, 0), (1, 0)]
    for entry in calls.values():
        assert entry["name"] == "get_weather" and entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER_PARAMS)
    assert calls[(0, 0)]["id"] != calls[(1, 0)]["id"]


async def test_tools_in_batch_lines(stack):  # noqa: F811
    """A batch line is a chat request like any other: its tools, tool_choice and n come back in its answer."""
    _, _, gateway = stack
    client = gateway.client()
    bodies = {
        "named": {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": NAMED,
                  "temperature": 0, "max_tokens": 96},
        "two": {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required", "n": 2,
                "temperature": 1.0, "seed": 3, "max_tokens": 96},
        "unknown": {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                    "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    }
    data = b"".join(json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}).encode() + b"\n" for key, body in bodies.items())
    uploaded = await client.files.create(file=("tools.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    async with asyncio.timeout(90):
        while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.3)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    output = {line["custom_id"]: line["response"]["body"] for line in map(
        json.loads, (await client.files.content(batch.output_file_id)).text.splitlines())}
    [named] = output["named"]["choices"]
    assert named["finish_reason"] == "tool_calls" and named["message"]["content"] is None
    [call] = named["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMS)
    assert sorted(c["index"] for c in output["two"]["choices"]) == [0, 1]
    for choice in output["two"]["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    [error] = map(json.loads, (await client.files.content(batch.error_file_id)).text.splitlines())
    assert error["custom_id"] == "unknown" and error["response"]["status_code"] == 400
    assert "get_time" in error["response"]["body"]["error"]["message"]
