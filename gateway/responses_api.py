"""OpenAI's Responses API shapes, translated onto the chat path's wire request. Pure: no HTTP, no Kafka.

A Responses body becomes a chat completions body (input items and `instructions` -> messages, `text.format`
-> response_format, `max_output_tokens` -> max_completion_tokens, sampling, service_tier, metadata,
prompt_cache_key) and goes through `openai_api.to_request`, so it is checked by the workers' own decoder and
priced by the same tiers and key ceiling as a chat request. `response_object` builds the answer,
`StreamEvents` the streamed events with their sequence numbers.
"""

from __future__ import annotations

from collections.abc import Collection

import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.openai_api import CHAT, ApiError, Tiers, bad_request, final_error, to_request
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, Usage

RESPONSES = "/v1/responses"
TERMINAL = ("completed", "failed", "cancelled", "incomplete")
UNSUPPORTED_FIELDS = ("previous_response_id", "conversation", "prompt", "include", "top_logprobs")
"""Refused when set (non-null, non-empty): they need stored conversations, reusable prompts or logprobs in
output items."""
INPUT_TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("system", "developer", "user", "assistant")


def new_response_id() -> str:
    return f"resp_{os.urandom(16).hex()}"


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in INPUT_TEXT_PARTS \
                    or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts (input_text, output_text) are supported",
                                  f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("content must be a string or a list of text parts", param)


def messages_of(body: dict) -> list[dict]:
    """`instructions` (a system message first) and `input`: a string (one user message) or message items."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise bad_request("input must not be empty", "input")
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of message items", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request("each input item must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "function_call":  # a call the model made earlier: consecutive ones are one assistant turn
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last.get("role") == "assistant" and last.get("tool_calls") and \
                    not last.get("content"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_request("output must be a string", f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            continue
        if kind != "message":
            raise bad_request(f"input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output)", f"input[{i}].type")
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"unsupported role {role!r} ({', '.join(ROLES)})", f"input[{i}].role")
        messages.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
    return messages


def text_format(body: dict) -> dict | None:
    """`text.format` as chat's response_format."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be an object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt["schema"]}}
    raise bad_request(f"unsupported text.format type {kind!r} (text, json_object, json_schema)", "text.format")


@dataclass(slots=True, frozen=True)
class ResponseOptions:
    """What shapes a response object besides its final: the request's own fields, echoed back."""

    model: str
    stream: bool
    background: bool
    store: bool
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    metadata: dict
    service_tier: str | None
    text: dict
    tools: list = field(default_factory=list)
    """As the request gave them (Responses' flat function tools), echoed in the response object."""
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True

    @property
    def may_call(self) -> bool:
        """Whether the answer may hold function calls: its text is then the worker's content outside them."""
        return bool(self.tools) and self.tool_choice != "none"

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_json(cls, data: dict) -> "ResponseOptions":
        return cls(**data)


def to_wire(body: Any, request_id: str, models: list[str], tiers: Tiers, *, priority_header: str | None = None,
            timeout_header: str | None = None, tenant: str | None = None, session_header: str | None = None,
            most_urgent: int = 0, adapters: Collection[str] = ()) -> tuple[GenerationRequest, int, ResponseOptions]:
    """(the wire request, its priority, the options echoed in the answer); ApiError for what cannot be served."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, [], {}, "", 0):
            raise bad_request(f"{name} is not supported by this gateway", name, "unsupported_parameter")
    tools = chat_tools(body.get("tools"))
    tool_choice = chat_tool_choice(body.get("tool_choice"))
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise bad_request("truncation must be 'disabled' or 'auto'", "truncation")
    background = body.get("background")
    stream = body.get("stream")
    store = body.get("store")
    for name, value in (("background", background), ("stream", stream), ("store", store)):
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", name)
    if background and stream:
        raise bad_request("a background response cannot be streamed here; poll GET /v1/responses/{id}", "stream",
                          "unsupported_parameter")
    if background and store is False:
        raise bad_request("a background response is stored: store must not be false", "store")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (not isinstance(max_output_tokens, int) or isinstance(max_output_tokens, bool)
                                          or max_output_tokens < 1):
        raise bad_request("max_output_tokens must be a positive integer", "max_output_tokens")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages_of(body), "stream": bool(stream)}
    for name in ("temperature", "top_p", "metadata", "service_tier", "prompt_cache_key", "timeout", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if max_output_tokens is not None:
        chat["max_completion_tokens"] = max_output_tokens
    if tools:
        chat["tools"] = tools
    if tool_choice is not None and (tools or tool_choice != "none"):
        chat["tool_choice"] = tool_choice
    if isinstance(body.get("parallel_tool_calls"), bool):
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = text_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    if isinstance(chat["model"], str) and chat["model"] not in models and chat["model"] not in adapters:
        raise ApiError(404, f"The model `{chat['model']}` does not exist; served: {', '.join([*models, *adapters])}",
                       code="model_not_found", param="model")
    try:
        wire, priority, chat_options = to_request(
            chat, CHAT, request_id, models, tiers, priority_header=priority_header, timeout_header=timeout_header,
            tenant=tenant, session_header=session_header, most_urgent=most_urgent, adapters=adapters)
    except ApiError as error:
        if error.param == "max_tokens" or error.param == "max_completion_tokens":
            error.param = "max_output_tokens"
        elif error.param == "response_format":
            error.param = "text.format"
        elif error.param and error.param.startswith("messages"):
            error.param = "input"
        elif error.param and error.param.startswith("tools["):  # tools[0].function.parameters -> tools[0]...
            error.param = error.param.replace(".function", "", 1)
        raise
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    options = ResponseOptions(
        model=chat_options.model, stream=bool(stream), background=bool(background), store=bool(background)
        if store is None else store, instructions=body.get("instructions"), max_output_tokens=max_output_tokens,
        temperature=wire.sampling.temperature, top_p=wire.sampling.top_p, metadata=dict(body.get("metadata") or {}),
        service_tier=chat_options.service_tier, text={"format": fmt or {"type": "text"}},
        tools=list(body.get("tools") or []), tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False)
    return wire, priority, options


def chat_tools(tools: Any) -> list[dict]:
    """Responses' function tools ({"type": "function", "name", "description", "parameters", "strict"}) as chat's
    ({"type": "function", "function": {...}}); the wire's decoder checks names and schemas."""
    if tools in (None, []):
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(f"tools of type {kind!r} are not supported (function only)", f"tools[{i}].type",
                              "unsupported_parameter")
        function = {"name": tool.get("name")}
        for name in ("description", "parameters"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice ({"type": "function", "name"} for a named one) as chat's."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def answer_of(done: FinalRecord | None, final: FinalRecord,
              options: ResponseOptions) -> tuple[str | None, list[dict]]:
    """(output text, function calls) of a request that ended with `final`, `done` its completion's final: with
    tools, the text is the worker's content outside the calls (None, no message item, when there is none)."""
    record = done if done is not None else final
    if not options.may_call:
        return record.text or "", []
    calls = [msgspec.to_builtins(call) for call in record.tool_calls or []]
    text = record.content if record.content is not None else (record.text or "")
    return (text or None) if calls else text, calls


def function_call_item(response_id: str, position: int, call: dict, status: str = "completed") -> dict:
    return {"id": f"fc_{response_id[5:]}_{position}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


# -- answers -------------------------------------------------------------------------------------------------

def usage_of(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def outcome(final: FinalRecord, finish_reason: str | None) -> tuple[str, dict | None, dict | None]:
    """(status, error, incomplete_details) of a response whose request ended with `final`: a completion cut by
    max_output_tokens is `incomplete` as OpenAI answers it; a refused or failed request `failed`."""
    if final.status == "completed":
        if finish_reason == "length":
            return "incomplete", None, {"reason": "max_output_tokens"}
        return "completed", None, None
    if final.status == "cancelled":
        return "cancelled", None, None
    error = final_error(final)
    code = "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 \
        else "invalid_prompt"
    return "failed", {"code": code, "message": error.message}, None


def response_object(response_id: str, created_at: int, options: ResponseOptions, *, status: str,
                    text: str | None = None, item_id: str | None = None, usage: Usage | dict | None = None,
                    error: dict | None = None, incomplete_details: dict | None = None,
                    completed_at: int | None = None, tool_calls: list[dict] | None = None) -> dict:
    output = [] if text is None else [
        message_item(item_id or f"msg_{response_id[5:]}", text, "completed" if status == "completed" else "incomplete")]
    output += [function_call_item(response_id, i, call) for i, call in enumerate(tool_calls or [])]
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": options.background, "completed_at": completed_at, "error": error,
        "incomplete_details": incomplete_details, "instructions": options.instructions,
        "max_output_tokens": options.max_output_tokens, "model": options.model, "output": output,
        "parallel_tool_calls": options.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": options.service_tier or "default", "store": options.store,
        "temperature": options.temperature, "text": options.text, "tool_choice": options.tool_choice,
        "tools": options.tools,
        "top_p": options.top_p, "truncation": "disabled",
        "usage": usage if isinstance(usage, dict) or usage is None else usage_of(usage),
        "user": None, "metadata": options.metadata,
    }


class StreamEvents:
    """The streamed events of one response, each with the next sequence number: created, in_progress, the
    message item and its output_text part added, the deltas, then text, part and item done and the terminal
    event (response.completed, .incomplete, .failed or .cancelled) with the whole response."""

    def __init__(self, response_id: str, options: ResponseOptions) -> None:
        self.response_id = response_id
        self.options = options
        self.created_at = int(time.time())
        self.item_id = f"msg_{response_id[5:]}"
        self.sequence = 0
        self.text: list[str] = []

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, **kw) -> dict:
        return response_object(self.response_id, self.created_at, self.options, status=status, **kw)

    def start(self) -> list[dict]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress")),
                self._event("response.output_item.added", output_index=0,
                            item={"id": self.item_id, "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []}),
                self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                            part=part)]

    def delta(self, text: str) -> dict:
        self.text.append(text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def finish(self, final: FinalRecord, finish_reason: str | None,
               tool_calls: list[dict] | None = None) -> list[dict]:
        """The closing events; `tool_calls`: the answer's function calls, each an output item after the message
        (its arguments in one delta: the worker parses a call whole before it is known to be one)."""
        text = "".join(self.text)
        status, error, incomplete = outcome(final, finish_reason)
        item = message_item(self.item_id, text, "completed" if status == "completed" else "incomplete")
        response = self._response(status, text=text, item_id=self.item_id, usage=final.usage, error=error,
                                  incomplete_details=incomplete, tool_calls=tool_calls,
                                  completed_at=int(time.time()) if status == "completed" else None)
        events = [self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                              text=text, logprobs=[]),
                  self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                              part=item["content"][0]),
                  self._event("response.output_item.done", output_index=0, item=item)]
        for i, call in enumerate(tool_calls or []):
            done = function_call_item(self.response_id, i, call)
            added = {**done, "arguments": "", "status": "in_progress"}
            index = i + 1
            events += [self._event("response.output_item.added", output_index=index, item=added),
                       self._event("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                                   delta=done["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                                   name=done["name"], arguments=done["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=done)]
        return [*events, self._event(f"response.{status}", response=response)]

    def error(self, error: ApiError) -> dict:
        return self._event("error", code=error.code, message=error.message, param=error.param)
