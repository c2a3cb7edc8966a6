"""Tool calling on the wire: the functions a request offers the model, the calls it made, and the structural check
of a function's `parameters` (a JSON Schema). Standard library and msgspec only: producers import it.

The check here is what a decoder can say without a grammar library: the schema's shape (keywords of the right
JSON types, subschemas that are schemas, type names that exist) and its depth. Whether the worker's grammar
library can keep a schema that passes it is known only when the worker compiles it (`tool_choice` required or a
named function), and a refusal then ends the request with error/invalid_request, as a response_format's would.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.limits import MAX_ID_CHARS

TOOL_NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names: the name goes into the prompt and into the grammar as a JSON string."""
MAX_SCHEMA_DEPTH = 32
"""Nesting of subschemas in one tool's parameters: deeper is refused at decode, before any compile sees it."""

ToolName = Annotated[str, Meta(pattern=TOOL_NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -, 1 to 64 chars.")]

JSON_TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_STRINGS = ("pattern", "format", "$ref", "title", "description", "$schema", "$id", "$anchor")


class FunctionSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    name: ToolName
    description: Annotated[str, Meta(description="Shown to the model with the function.")] | None = None
    parameters: Annotated[dict[str, Any], Meta(description=(
        "A JSON Schema of the arguments object (its `type`, when given, is \"object\"). Absent: the function "
        "takes no arguments."))] | None = None
    strict: Annotated[bool, Meta(description="Informational: forced calls always follow the schema.")] | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema a call's arguments must satisfy; `{}` arguments for a function that declares none."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class Tool(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One function the model may call (OpenAI's shape)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ToolChoiceFunction(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    name: ToolName


class NamedToolChoice(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Force one call of this function."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice
"""auto: the model may answer or call; none: it answers (tools are not shown, calls are not parsed); required:
it calls one of the tools (several with parallel_tool_calls); a named function: it calls that one, once."""


class FunctionCall(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    name: ToolName
    arguments: Annotated[str, Meta(description=(
        "The arguments as JSON text (OpenAI's shape). A forced call's always parse and satisfy the function's "
        "schema; an unforced (auto) call's are what the model wrote, and may not."))]


class ToolCall(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """A call the model made: in a final record, and in an assistant message of a later turn."""

    id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, description=(
        "call_ and 24 random letters and digits when the worker made it; the tool message answering it names "
        "it in tool_call_id."))]
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """A piece of one tool call in a stream chunk (OpenAI's `delta.tool_calls` entry): the first piece of a call
    has its id and name, the pieces after it fragments of its arguments text, in order."""

    index: Annotated[int, Meta(ge=0, le=1_000_000, description="Which call of the completion, 0, 1, ...")]
    id: str | None = None
    name: ToolName | None = None
    arguments: Annotated[str, Meta(description="The next fragment of the arguments text.")] = ""


def schema_problem(schema: Any, path: str = "parameters", depth: int = 0) -> str | None:
    """What makes `schema` not a JSON Schema, or None. Reads only its shape (see the module docstring)."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path} must be a JSON Schema (an object or a boolean)"
    if depth > MAX_SCHEMA_DEPTH:
        return f"{path} nests subschemas deeper than {MAX_SCHEMA_DEPTH}"
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            return f"{path}.type must be one of {', '.join(sorted(JSON_TYPES))} or a list of them, got {kind!r}"
    for key in _SUBSCHEMA:
        if key in schema and (problem := schema_problem(schema[key], f"{path}.{key}", depth + 1)):
            return problem
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            items = schema[key]
            if not isinstance(items, list) or not items:
                return f"{path}.{key} must be a non-empty list of schemas"
            for i, item in enumerate(items):
                if problem := schema_problem(item, f"{path}.{key}[{i}]", depth + 1):
                    return problem
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            entries = schema[key]
            if not isinstance(entries, dict):
                return f"{path}.{key} must be an object of schemas"
            for name, item in entries.items():
                if problem := schema_problem(item, f"{path}.{key}.{name}", depth + 1):
                    return problem
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        return f"{path}.required must be a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{path}.enum must be a list"
    for key in _NUMBERS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{path}.{key} must be a number"
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"{path}.{key} must be a non-negative integer"
    for key in _STRINGS:
        if key in schema and not isinstance(schema[key], str):
            return f"{path}.{key} must be a string"
    return None


def parameters_problem(parameters: dict[str, Any]) -> str | None:
    """What makes a function's parameters unusable: not a JSON Schema, or one that is not of an object."""
    kind = parameters.get("type")
    if kind is not None and kind != "object":
        return f"parameters must describe the arguments object (type \"object\"), got type {kind!r}"
    return schema_problem(parameters)
