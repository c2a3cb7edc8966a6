"""Refusals found by reading a format, before the grammar library sees it.

Two shapes of pathological format cost the library the most to refuse, because it refuses them only on reaching
a limit: a regex with a huge repetition count (`a{1000000}`: 9 ms at the first pass's cut lexer fuel, then a
judge process, up to a second at the full fuel) and a JSON schema whose every document nests without end (a
required property whose schema is, through `$ref`, its own object again: 5 ms, then a judge). Both can be told
from the text in microseconds, and the answer is certain, so they are refused here with a message that says
what was found. Everything else, and every variant these checks do not recognise (a repetition nested in
another, a cycle through `anyOf`), goes to the library and its limits as before: the screen only makes refusals
cheaper, it is not what keeps the contract.
"""

from __future__ import annotations

import json
import re

MAX_REGEX_REPEAT = 100_000
"""The largest count a regex repetition (`{n}`, `{n,}`, `{n,m}`) may name. The library builds `a{200000}` at
its full limits in 0.6 s of CPU and refuses `a{1000000}` after about a second; no format an ordinary service
sends comes near (RE2 stops at 1,000)."""

_BIG_COUNT = re.compile(r"\{\s*\d*\s*,?\s*\d{%d,}" % len(str(MAX_REGEX_REPEAT)))
"""A cheap filter: some brace holds a number as long as the limit's. Only such regexes are read closely."""
_REGEX_TOKEN = re.compile(r"\\.|\[\^?\]?|\]|\{(\d*)(?:,(\d*))?\}|[^\\\[\]{]+|.", re.S)
"""An escape, a class opening (with a leading literal `]`), a class closing, a repetition, a run of plain text."""


def screen(kind: str, spec: str) -> str | None:
    """A refusal message for a format that certainly cannot be kept or built within the limits, else None."""
    if kind == "regex":
        return _regex_repeat(spec)
    big_count = _BIG_COUNT.search(spec)  # a schema's `pattern` is a regex too (an unanchored one)
    has_ref = '"$ref"' in spec  # no endless nesting without a reference back
    if kind != "json_schema" or not (big_count or has_ref):
        return None
    try:
        root = json.loads(spec)
    except ValueError:
        return None
    for pattern in _patterns(root) if big_count else ():
        refusal = _regex_repeat(pattern)
        if refusal is not None:
            return f"in a schema's pattern, {refusal}"
    return _endless_nesting(root) if has_ref and isinstance(root, dict) else None


_VALUES = frozenset({"const", "default", "enum", "example", "examples"})
"""Keywords whose contents are JSON values, not schemas: a "pattern" key inside them is data."""


def _patterns(schema: object) -> list[str]:
    """Every `pattern` string and `patternProperties` key in a JSON schema, wherever it sits."""
    stack, found = [schema], []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(node["patternProperties"])
            stack.extend(value for key, value in node.items() if key not in _VALUES)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _regex_repeat(regex: str) -> str | None:
    if not _BIG_COUNT.search(regex):
        return None
    depth = 0  # inside a character class (classes nest in the library's syntax), braces are literal
    for match in _REGEX_TOKEN.finditer(regex):
        token = match.group()
        if token.startswith("["):
            depth += 1
        elif token == "]" and depth:
            depth -= 1
        elif token.startswith("{") and not depth:
            if max((int(group) for group in match.groups() if group), default=0) > MAX_REGEX_REPEAT:
                return (f"a regex repetition is over the limit of {MAX_REGEX_REPEAT:,} (worker limit "
                        f"grammar_screen.MAX_REGEX_REPEAT={MAX_REGEX_REPEAT}): {token}")
    return None


def _endless_nesting(root: dict) -> str | None:
    """A cycle of must-contain edges from the root: an object schema (type "object") that requires a property,
    or an array schema (type "array", minItems at least 1) whose first item has a schema that leads, through
    `$ref` and `allOf`, back to it. Every document would hold an instance inside an instance without end, so
    none is finite. Only edges every instance must follow count; a cycle that an
    `anyOf`, a type list or an optional property can leave is left to the library."""
    def resolve(ref: object) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node: object = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def edges(schema: dict) -> list[tuple[dict, str | None]]:
        """(schema every instance must also satisfy, the property it sits in, or None for the same value)."""
        out: list[tuple[dict, str | None]] = []
        target = resolve(schema.get("$ref"))
        if target is not None:
            out.append((target, None))
        for member in schema.get("allOf") or ():
            if isinstance(member, dict):
                out.append((member, None))
        kind = schema.get("type")
        kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
        properties = schema.get("properties")
        if kind == "object" and isinstance(properties, dict):
            for name in schema.get("required") or ():
                child = properties.get(name) if isinstance(name, str) else None
                if isinstance(child, dict):
                    out.append((child, name))
        first = schema.get("prefixItems") or [schema.get("items")]
        minimum = schema.get("minItems")
        if kind == "array" and isinstance(minimum, int) and minimum >= 1 and isinstance(first[0], dict):
            out.append((first[0], "[0]"))
        return out

    # The strongly connected parts of the graph reachable from the root (Tarjan's, without recursion): an edge
    # into a property inside one of them is a nesting every document must repeat without end.
    nodes: list[dict] = [root]
    out: list[list[tuple[int, str | None]]] = []
    index = {id(root): 0}
    for node in nodes:  # grows while walked: every schema reachable by a must-edge, once
        targets = []
        for child, via in edges(node):
            if id(child) not in index:
                index[id(child)] = len(nodes)
                nodes.append(child)
            targets.append((index[id(child)], via))
        out.append(targets)
    order, low, part = [-1] * len(nodes), [0] * len(nodes), [-1] * len(nodes)
    seen, held, counter, parts = [], [False] * len(nodes), 0, 0
    for start in range(len(nodes)):
        if order[start] >= 0:
            continue
        work = [(start, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                order[node] = low[node] = counter
                counter += 1
                seen.append(node)
                held[node] = True
            if next_edge < len(out[node]):
                work.append((node, next_edge + 1))
                child = out[node][next_edge][0]
                if order[child] < 0:
                    work.append((child, 0))
                elif held[child]:
                    low[node] = min(low[node], order[child])
                continue
            if low[node] == order[node]:
                while True:
                    member = seen.pop()
                    held[member] = False
                    part[member] = parts
                    if member == node:
                        break
                parts += 1
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    for node, targets in enumerate(out):
        for child, via in targets:
            if via is not None and part[child] == part[node]:
                where = "the first item" if via == "[0]" else f"the required property {via!r}"
                return ("no output satisfies the format (its language is empty): every document must nest "
                        f"without end, through {where}")
    return None
