"""The real SmolLM2-135M-Instruct, its template without tools (the generic format), and a forced call: the
grammar makes the call valid, and the prompt makes it about the question (a random model would name any city)."""

from __future__ import annotations

import json
import time

import jsonschema
import msgspec
import pytest
from aiokafka import TopicPartition

from schemas.request import GenerationRequest
from worker.tools.parse import ToolCallParser
from worker.transport.requests.dispatcher import to_engine_requests
from worker.transport.requests.local_queue import QueuedRequest

pytestmark = pytest.mark.slow

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}


def test_a_forced_call_on_smollm2_names_the_city_asked_about(smollm2_path):
    from worker.model.settings import EngineSettings
    from worker.engine.engine import LLMEngine

    engine = LLMEngine(EngineSettings(model=str(smollm2_path), device="cpu", dtype="float32", max_num_seqs=2,
                                      max_model_len=1024))
    assert not engine.native_tools
    wire = msgspec.convert({
        "id": "t", "max_new_tokens": 48,
        "messages": [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                     "parameters": PARAMETERS}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, GenerationRequest)
    queued = QueuedRequest(request=wire, partition=TopicPartition("t", 0), offset=0, priority=0, attempt=0,
                           timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="t",
                           num_prompt_tokens=1)
    [request] = to_engine_requests(queued)
    parser = ToolCallParser(frozenset({"get_weather"}), wire.parallel_tool_calls)
    outputs = engine.add_request(request)
    finish = None
    while finish is None:
        for out in outputs:
            parser.feed(out.text_delta)
            finish = out.finish_reason if out.finished else None
        outputs = [] if finish else engine.step()
    parser.finish()
    assert finish == "stop"
    [call] = parser.calls
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, PARAMETERS)
    assert arguments["city"] == "Paris" and parser.content == ""
