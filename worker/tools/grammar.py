"""The grammar a forced tool call follows (tool_choice required or a named function), in llguidance's Lark
dialect: the `<tool_call>` tags around one JSON object per call whose `name` is one of the functions and whose
`arguments` satisfy that function's schema (an anyOf with one branch per function). The JSON is on one line,
with the separators the structured-output path uses, so a forced call looks like one the model writes itself.
"""

from __future__ import annotations

import json
from typing import Any

from worker.tools.render import CLOSE, OPEN

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""The structured-output path's JSON options (worker.model.structured.compile.JSON_OPTIONS, which the transport,
where this grammar is built, may not import; a test keeps the two equal)."""


def call_schema(functions: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The JSON Schema of one call: {name, arguments} of one of the functions ((name, arguments schema) pairs)."""
    branches = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, schema in functions]
    return {"x-guidance": JSON_OPTIONS, "anyOf": branches}


def tool_call_grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """Lark text: one call of the functions, or (parallel) one or more separated by newlines."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([
        start,
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
        f"body: %json{json.dumps(call_schema(functions), ensure_ascii=False)}",
        "",
    ])
