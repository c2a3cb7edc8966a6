"""The Responses API's translation onto the wire request, its answer and stream shapes, and webhook signing and
configuration (no broker)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import openai
import pytest

from gateway.openai_api import ApiError, Tiers
from gateway.responses_api import StreamEvents, outcome, response_object, to_wire
from gateway.webhooks import configuration_error, new_secret, sign
from schemas.result import FinalRecord, Usage
from tests.transport.kafka_helpers import REPO
from gateway.settings import GatewaySettings

MODEL = "smollm2-135m-instruct"
TIERS = Tiers(3, 1)


def wire(body: dict, **kw):
    return to_wire({"model": MODEL, **body}, "resp_x.0", [MODEL], TIERS, **kw)


def test_input_instructions_format_and_sampling_reach_the_wire_request():
    request, priority, options = wire({
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text",
                                                                                      "text": "there"}]},
                  {"type": "message", "role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Name?"}],
        "instructions": "Answer in JSON.", "max_output_tokens": 40, "temperature": 0.5, "top_p": 0.9,
        "metadata": {"job": "7"}, "service_tier": "flex",
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}}},
        tenant="acme")
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Answer in JSON."), ("user", "Hi there"), ("assistant", "Hello"), ("user", "Name?")]
    assert request.max_new_tokens == 40 and request.sampling.temperature == 0.5 and request.sampling.top_p == 0.9
    assert request.response_format is not None and request.metadata == {"job": "7"}
    assert request.tenant == "acme" and priority == 2 and not request.stream
    assert options.max_output_tokens == 40 and options.text["format"]["type"] == "json_schema"
    plain, priority, options = wire({"input": "Hello", "stream": True})
    assert [m.role for m in plain.messages] == ["user"] and plain.stream and priority == 1
    assert not options.background and not options.store


@pytest.mark.parametrize("body, param, status", [
    ({"input": ""}, "input", 400),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output", 400),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", 400),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", 400),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}},
     "tool_choice", 400),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", 400),
    ({"input": "x", "background": True, "stream": True}, "stream", 400),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", 400),
    ({"input": "x", "temperature": 3}, None, 400),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", 400),
    ({"input": "x", "service_tier": "priority"}, "service_tier", 403),
    ({"input": "x", "model": "other"}, "model", 404),
])
def test_bad_input_is_refused_in_openais_shape(body, param, status):
    with pytest.raises(ApiError) as info:
        wire(body, most_urgent=1)
    assert info.value.status == status
    if param is not None:
        assert info.value.param == param, info.value


def test_function_tools_and_call_items_become_the_chat_path_s_tools_and_turns():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    request, _, options = wire({
        "input": [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city":"Paris"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}],
        "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": params,
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
    assert [t.function.name for t in request.tools] == ["get_weather"]
    assert request.tool_choice.function.name == "get_weather" and request.parallel_tool_calls is False
    assert [m.role for m in request.messages] == ["user", "assistant", "tool"]
    assert request.messages[1].tool_calls[0].id == "call_1" and request.messages[2].tool_call_id == "call_1"
    assert options.may_call and options.tools[0]["name"] == "get_weather"
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    body = response_object("resp_" + "0" * 32, 0, options, status="completed", text=None, tool_calls=[call])
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert body["output"][0]["call_id"] == "call_9" and body["tool_choice"] == {"type": "function",
                                                                                 "name": "get_weather"}
    # The SDK reads it as its own Response model.
    assert openai.types.responses.Response.model_validate(body).output[0].arguments == '{"city":"Oslo"}'


def test_outcome_and_the_stream_events():
    usage = Usage(prompt_tokens=5, completion_tokens=3)
    done = FinalRecord(id="r", status="completed", reason="stop", finish_reason="stop", usage=usage)
    assert outcome(done, "stop")[0] == "completed"
    assert outcome(done, "length") == ("incomplete", None, {"reason": "max_output_tokens"})
    shed = FinalRecord(id="r", status="rejected", reason="shed")
    status, error, _ = outcome(shed, None)
    assert status == "failed" and error["code"] == "rate_limit_exceeded"
    _, _, options = wire({"input": "x"})
    events = StreamEvents("resp_abc", options)
    stream = [*events.start(), events.delta("Hel"), events.delta("lo"), *events.finish(done, "stop")]
    assert [e["type"] for e in stream] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    last = stream[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == "Hello" and last["usage"]["output_tokens"] == 3
    # The SDK's own model reads it, output_text included.
    parsed = openai.types.responses.Response.model_validate(last)
    assert parsed.output_text == "Hello" and parsed.usage.input_tokens == 5
    queued = openai.types.responses.Response.model_validate(response_object("resp_q", 1, options, status="queued"))
    assert queued.status == "queued" and queued.output == []


def test_signatures_verify_with_the_openai_sdk():
    secret = new_secret()
    body = msgspec.json.encode({"id": "evt_1", "object": "event", "type": "response.completed", "created_at": 1,
                                "data": {"id": "resp_1"}})
    import time
    now = int(time.time())
    headers = {"webhook-id": "evt_1", "webhook-timestamp": str(now), "webhook-signature": sign(secret, "evt_1", now,
                                                                                              body)}
    client = openai.OpenAI(api_key="-", base_url="http://127.0.0.1:1")
    event = client.webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "response.completed" and event.data.id == "resp_1"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body + b" ", headers, secret=secret)


def test_webhook_settings_are_checked():
    ok = GatewaySettings(webhook_urls=["http://hooks.internal:9000/in"], webhook_secret=new_secret(),
                         webhook_allowed_hosts=["hooks.internal"])
    assert configuration_error(ok) is None
    assert "GATEWAY_WEBHOOK_ALLOWED_HOSTS" in configuration_error(ok.model_copy(update={
        "webhook_urls": ["http://evil.example/in"]}))
    assert "GATEWAY_WEBHOOK_SECRET" in configuration_error(ok.model_copy(update={"webhook_secret": "plain"}))


def test_a_gateway_with_a_webhook_url_not_allowed_refuses_to_start_in_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "GATEWAY_DATA_DIR": str(tmp_path), "GATEWAY_WEBHOOK_URLS": '["http://a.b/x"]',
           "GATEWAY_WEBHOOK_SECRET": new_secret(), "GATEWAY_WEBHOOK_ALLOWED_HOSTS": '["c.d"]',
           "LLM_WORKER_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "worker.cli", "gateway"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "GATEWAY_WEBHOOK_ALLOWED_HOSTS" in lines[0], done.stderr
