"""What the engine is given for a tools request: the tools shown (none with tool_choice none), the messages with
their calls and results, and a grammar only for a forced call."""

from __future__ import annotations

import time

import msgspec
from aiokafka import TopicPartition

from schemas.request import GenerationRequest
from worker.transport.requests.dispatcher import to_engine_requests
from worker.transport.requests.local_queue import QueuedRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Now"}}
MESSAGES = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def engine_request(**fields):
    request = msgspec.convert({"id": "r", "messages": MESSAGES, "tools": [WEATHER, CLOCK], **fields},
                              GenerationRequest)
    queued = QueuedRequest(request=request, partition=TopicPartition("t", 0), offset=0, priority=0, attempt=0,
                           timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="r",
                           num_prompt_tokens=1)
    [engine] = to_engine_requests(queued)
    return engine


def test_auto_shows_the_tools_and_constrains_nothing():
    engine = engine_request()
    assert engine.sampling.structured is None
    assert engine.tools == [WEATHER, {"type": "function", "function": {
        "name": "get_time", "description": "Now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    assert engine.messages == MESSAGES


def test_none_hides_the_tools_but_keeps_the_history():
    engine = engine_request(tool_choice="none")
    assert engine.tools is None and engine.sampling.structured is None and engine.messages == MESSAGES


def test_a_forced_call_is_a_grammar_over_the_functions_it_may_call():
    named = engine_request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.sampling.structured.kind == "grammar"
    spec = named.sampling.structured.spec
    assert spec.startswith("start: call\n") and '"get_time"' in spec and "get_weather" not in spec
    required = engine_request(tool_choice="required").sampling.structured.spec
    assert required.startswith('start: call ("\\n" call)*') and "get_weather" in required and "get_time" in required
    single = engine_request(tool_choice="required", parallel_tool_calls=False).sampling.structured.spec
    assert single.startswith("start: call\n")
