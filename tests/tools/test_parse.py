"""The tool-call parser: calls and content out of text however it is cut into deltas, and the streamed pieces
adding up to the final calls."""

from __future__ import annotations

import json

import pytest

from worker.tools.parse import ToolCallParser

NAMES = frozenset({"get_weather", "get_time"})
CALL_1 = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}}\n'
          '</tool_call>')
CALL_2 = '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'


def run(text: str, step: int, names=NAMES, parallel: bool = True):
    """Feed `text` in pieces of `step` chars; returns (parser, streamed content, calls assembled from pieces)."""
    parser = ToolCallParser(names, parallel)
    content, pieces = [], []
    for i in range(0, len(text), step):
        c, p = parser.feed(text[i:i + step])
        content.append(c)
        pieces += p
    c, p = parser.finish()
    content.append(c)
    pieces += p
    assembled: dict[int, dict] = {}
    for piece in pieces:
        call = assembled.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
        if piece.id is not None:
            assert call["id"] is None, "a call's first piece comes once"
            call["id"], call["name"] = piece.id, piece.name
        call["arguments"] += piece.arguments
    return parser, "".join(content), [assembled[i] for i in sorted(assembled)]


@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_calls_and_content_whatever_the_deltas(step):
    text = f"Let me check.\n{CALL_1}\n{CALL_2}\n"
    parser, content, streamed = run(text, step)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": 'Pa}ris "x"', "days": [1, {"a": 2}]}), ("get_time", {})]
    assert parser.calls[0].arguments == '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}'  # as written
    assert streamed == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parser.calls]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parser.calls)
    assert content == parser.content == "Let me check."


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_what_is_not_a_call_of_an_offered_function_stays_content(step):
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    broken = "<tool_call>{not json</tool_call>"
    text = f"{unknown} and {broken} and <tool_ca"
    parser, content, streamed = run(text, step)
    assert parser.calls == [] and streamed == []
    assert content == parser.content == text


def test_a_close_tag_inside_the_arguments_does_not_end_the_call():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "</tool_call>"}}\n</tool_call>after'
    for step in (1, 3, 100):
        parser, content, _ = run(text, step)
        assert json.loads(parser.calls[0].arguments) == {"tz": "</tool_call>"}
        assert content == "after"


def test_a_call_cut_short_keeps_what_was_written_and_parallel_false_keeps_the_first():
    parser, content, streamed = run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', 4)
    assert parser.calls[0].arguments == '{"city": "Pa' and streamed[0]["arguments"] == '{"city": "Pa'
    assert content == ""
    parser, content, streamed = run(f"{CALL_1}\n{CALL_2}", 6, parallel=False)
    assert [c.name for c in parser.calls] == ["get_weather"] and len(streamed) == 1 and content == ""


def test_an_unclosed_block_that_is_a_whole_call_counts():
    parser, content, _ = run('<tool_call>\n{"arguments": {"x": 1}, "name": "get_time"}', 5)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", '{"x": 1}')] and content == ""


def test_content_only_is_trimmed_and_kept_whole():
    parser, content, streamed = run("\n  Hello <b>world</b>\n\nbye  \n", 3)
    assert content == parser.content == "Hello <b>world</b>\n\nbye" and streamed == []
