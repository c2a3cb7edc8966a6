"""The gateway's pure parts: OpenAI bodies to wire requests (and the refusals), answers' shapes, the status
map of finals, and the batch files (parsing, resuming, never writing an answer twice). No broker."""

from __future__ import annotations

import json

import pytest

from gateway.batch_run import AnswerFile, parse_input
import msgspec

from gateway.openai_api import (CHAT, COMPLETIONS, ApiError, Tiers, TokenText, chat_logprobs, completion_body,
                                delta_choice, final_error, text_logprobs, to_request, tool_call_deltas)
from schemas.result import FinalRecord, TokenLogprob, TopLogprob, Usage
from schemas.tools import ToolCallDelta

TIERS = Tiers(num_priorities=3, default_priority=1)
MODELS = ["m"]


def chat(**body):
    return to_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, CHAT, "r1", MODELS,
                      TIERS)


def test_a_chat_body_becomes_the_wire_request():
    request, priority, options = chat(
        max_completion_tokens=9, temperature=0.5, top_p=0.9, seed=7, stop="END", presence_penalty=0.5,
        frequency_penalty=-0.5, n=2, logprobs=True, top_logprobs=3, stream=True,
        stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert (request.id, request.max_new_tokens, request.n, request.stream, priority) == ("r1", 9, 2, True, 1)
    s = request.sampling
    assert (s.temperature, s.top_p, s.seed, s.stop, s.presence_penalty, s.frequency_penalty) == \
        (0.5, 0.9, 7, ["END"], 0.5, -0.5)
    assert (s.logprobs, s.top_logprobs) == (True, 3)
    assert request.response_format.json_schema.schema == {"type": "object"}
    assert options.include_usage and options.n == 2
    # OpenAI's default temperature is 1; max_tokens is the older name of the limit.
    request, _, _ = chat(max_tokens=5)
    assert (request.sampling.temperature, request.max_new_tokens) == (1.0, 5)


def test_service_tier_header_and_timeout_map_to_priority_and_timeout_ms():
    assert chat(service_tier="priority")[1] == 0
    assert chat(service_tier="default")[1] == 1
    assert chat(service_tier="flex")[1] == 2
    request, priority, _ = to_request({"model": "m", "prompt": "x", "timeout": 2.5}, COMPLETIONS, "r", MODELS,
                                      TIERS, priority_header="2")
    assert (priority, request.timeout_ms, request.prompt) == (2, 2500, "x")
    request, _, _ = to_request({"model": "m", "prompt": [[1, 2, 3]]}, COMPLETIONS, "r", MODELS, TIERS,
                               timeout_header="700")
    assert (request.timeout_ms, request.prompt_token_ids) == (700, [1, 2, 3])


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope"}, 404, "model"),
    ({"n": 17}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"temperature": 3}, 400, None),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"service_tier": "gold"}, 400, "service_tier"),
    ({"response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
])
def test_refusals_are_openai_errors(body, status, param):
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == status and info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_priority_header_out_of_range_is_refused():
    with pytest.raises(ApiError):
        to_request({"model": "m", "prompt": "x"}, COMPLETIONS, "r", MODELS, TIERS, priority_header="3")


def test_finals_map_to_http_statuses():
    def final(status, reason):
        return FinalRecord(id="r", status=status, reason=reason, message="why")

    shed = final_error(final("rejected", "shed"), retry_after_s=7.2)
    assert shed.status == 429 and shed.headers == {"Retry-After": "8"}
    assert final_error(final("rejected", "deadline")).status == 504
    assert final_error(final("error", "invalid_request")).status == 400
    assert final_error(final("error", "prompt_too_long")).status == 400
    assert final_error(final("error", "internal")).status == 500
    assert final_error(final("cancelled", "cancelled")).status == 409


def test_answers_have_openai_shapes_and_logprobs():
    _, _, options = chat(n=2, logprobs=True, top_logprobs=1)
    lp = [TokenLogprob(token_id=5, logprob=-0.1, top_logprobs=[TopLogprob(token_id=5, logprob=-0.1)])]
    done = [FinalRecord(id="r", status="completed", reason="stop", finish_reason="stop", text="a", index=i,
                        logprobs=lp) for i in range(2)]
    final = FinalRecord(id="r", status="completed", reason="stop", finish_reason="stop",
                        usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1))
    body = completion_body(options, "r", 1, final, done, TokenText(None))
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:5" and entry["top_logprobs"][0]["logprob"] == -0.1
    assert chat_logprobs(TokenText(None), None) is None
    legacy = text_logprobs(TokenText(None), lp)
    assert legacy["tokens"] == ["token_id:5"] and legacy["top_logprobs"] == [{"token_id:5": -0.1}]


def line(custom_id, url="/v1/chat/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m"}}).encode()


def test_batch_input_keeps_good_lines_and_answers_bad_ones():
    data = b"\n".join([line("a"), b"{broken", line("a"), line("b", "/v1/embeddings"), b"", b"[1]", line("c")])
    lines, errors = parse_input(data)
    assert [(x.custom_id, x.number) for x in lines] == [("a", 1), ("c", 7)]
    assert [key for key, _ in errors] == ["#line2", "#line3", "b", "#line6"]
    assert errors[0][1]["error"]["code"] == "invalid_json" and errors[0][1]["response"] is None
    _, errors = parse_input(line("x", "/v1/completions"), endpoint="/v1/chat/completions")
    assert errors[0][0] == "x"


async def test_answer_file_resumes_cuts_a_half_line_and_never_writes_twice(tmp_path):
    path = tmp_path / "out.jsonl"
    answers = AnswerFile(path).open()
    assert answers.write("a", {"custom_id": "a"}) and not answers.write("a", {"custom_id": "a"})
    await answers.close()
    with open(path, "ab") as f:
        f.write(b'{"custom_id": "b", "resp')  # a kill in the middle of a line
    again = AnswerFile(path).open()
    assert again.keys == {"a"} and again.num_lines == 1
    assert again.write("b", {"custom_id": "b"}) and not again.write("a", {"custom_id": "a"})
    await again.drain()
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["a", "b"]
    await again.close()
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["a", "b"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_calls_and_results_reach_the_wire_and_answers_carry_calls():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    request, _, options = chat(messages=messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert request.forces_tool_call and not request.parallel_tool_calls and options.tools
    assert request.messages[1].content is None and request.messages[2].tool_call_id == "call_1"
    assert request.messages[2].content == "sunny"
    # An empty tools list is no tools (as the SDKs send it); tool_choice none then goes too.
    _, _, no_tools = chat(tools=[], tool_choice="none")
    assert not no_tools.tools

    call = {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    final = msgspec.convert({"kind": "final", "id": "r1", "status": "completed", "reason": "tool_calls",
                             "finish_reason": "tool_calls", "text": "<tool_call>...", "content": "",
                             "tool_calls": [call]}, FinalRecord)
    choice = completion_body(options, "r1", 0, final, [final], TokenText())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] == [call]
    pieces = [ToolCallDelta(index=0, id="call_x", name="get_weather"), ToolCallDelta(index=0, arguments='{"ci')]
    delta = delta_choice(options, 0, "", None, TokenText(), tool_calls=tool_call_deltas(pieces))["delta"]
    assert delta == {"content": None, "tool_calls": [
        {"index": 0, "id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"ci'}}]}


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "properties": {"x": {"type": 7}}}}}]},
     "tools", "parameters.properties.x.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names 'nope'"),
    ({"function_call": "auto", "functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_tools_are_refused_before_anything_is_produced(body, param, words):
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message
