"""Chat messages and tools into the shape the model's chat template renders.

A template that shows tools itself and writes calls in `<tool_call>` tags (Qwen2.5, Hermes) gets the tools as
its `tools` argument and the conversation as it is, each call's arguments as an object. Any other template
(SmolLM2's has no tools at all; Llama 3.1's writes calls as bare JSON, which the parser and the grammar do not
read) gets the generic format instead: a system section that lists the functions as JSON and shows the call
syntax, assistant calls written out in `<tool_call>` tags, and tool results as user turns in
`<tool_response>` tags; consecutive results share one turn. The same history is rendered the same way whether
or not the request offers tools, so the turns of a conversation keep their prefix.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SECTION_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
SECTION_TAIL = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


def template_renders_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Whether a chat template shows tools itself in the convention the worker parses. A tokenizer with several
    named templates (a dict) is read as the one transformers picks when given tools: `tool_use`, else
    `default`."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The generic format's system section: one function per line, as JSON."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    return "\n".join([SECTION_HEAD, *lines, SECTION_TAIL])


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; arguments that are JSON are written as it, others as a string."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': value}, ensure_ascii=False)}\n{CLOSE}"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template(messages, tools=tools)`. `messages`: the wire's chat messages
    as dicts (role, content, and tool_calls or tool_call_id where set); `tools`: the wire's tools, None when the
    model is not shown any (no tools, or tool_choice none); `native`: template_renders_tools."""
    if native:
        out = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in message["tool_calls"]]
            out.append(message)
        return out, tools
    out = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = message.get("content")
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        else:
            out.append({"role": role, "content": message.get("content") or ""})
    for message in out:
        message.pop("tool_responses", None)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None
