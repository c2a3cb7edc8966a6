"""grammar_screen: the pathological formats refused from their text, and the look-alikes it must let through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.model.structured.screen import MAX_REGEX_REPEAT, screen

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


def via_defs(node: dict) -> str:
    return json.dumps({"$defs": {"n": node}, "$ref": "#/$defs/n"})


ENDLESS = {
    "required-ref": via_defs(NODE),
    "type-as-one-item-list": via_defs({**NODE, "type": ["object"]}),
    "array-of-at-least-one": json.dumps({"type": "array", "minItems": 1, "items": {"$ref": "#"}}),
    "first-prefix-item": json.dumps({"type": "array", "minItems": 1, "prefixItems": [{"$ref": "#"}]}),
    "through-all-of": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/m"}}, "required": ["a"],
                                  "$defs": {"m": {"allOf": [{"$ref": "#"}]}}}),
    "two-definitions": json.dumps({"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
        "type": "object", "properties": {"x": {"type": "integer"}, "start": {"$ref": "#/$defs/a"}},
        "required": ["x", "start"]}),
}
FINITE = {
    "optional": via_defs({**NODE, "required": []}),
    "may-be-null": via_defs({**NODE, "type": ["object", "null"]}),
    "no-type": via_defs({k: v for k, v in NODE.items() if k != "type"}),  # 5 is an instance: required is for objects
    "any-of-a-way-out": via_defs({**NODE, "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"},
                                                                           {"type": "null"}]}}}),
    "empty-array-allowed": json.dumps({"type": "array", "items": {"$ref": "#"}}),
    "first-item-is-not-the-cycle": json.dumps({"type": "array", "minItems": 2, "prefixItems": [{"type": "integer"}],
                                               "items": {"$ref": "#"}}),
    "same-value-cycle-only": json.dumps({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
                                         "$ref": "#/$defs/a"}),
    "ordinary-refs": json.dumps({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}},
                                                 "required": ["x"]}},
                                 "type": "object", "required": ["a", "b"],
                                 "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}}}),
    "remote-ref": json.dumps({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}},
                              "required": ["a"]}),
    "not-json": '{"$ref": ',
}


@pytest.mark.parametrize("name", ENDLESS)
def test_a_schema_whose_every_document_nests_without_end_is_refused_as_empty(name):
    refusal = screen("json_schema", ENDLESS[name])
    assert refusal is not None and refusal.startswith("no output satisfies the format (its language is empty)")
    assert "nest without end" in refusal


@pytest.mark.parametrize("name", FINITE)
def test_a_schema_with_a_finite_document_or_one_it_cannot_read_is_left_to_the_library(name):
    assert screen("json_schema", FINITE[name]) is None


@pytest.mark.parametrize("regex", ["a{1000000}", "x{5,1000001}", "(ab){100001,}", "[a[b]]{1000001}", "[]]{200000}",
                                   r"\\{1000000}", "a{}b{1000000}"])
def test_a_regex_repetition_past_the_limit_is_refused_naming_it(regex):
    refusal = screen("regex", regex)
    assert refusal is not None and f"MAX_REGEX_REPEAT={MAX_REGEX_REPEAT}" in refusal


@pytest.mark.parametrize("regex", [f"a{{{MAX_REGEX_REPEAT}}}", "a{1000}", r"\{1000000}", "[{1000000}]",
                                   "[]{1000000}]", "[^]{1000000}]", "x{,5}", "(a{1000}){1000}", "[0-9]{5}"])
def test_literal_braces_and_counts_within_the_limit_are_left_to_the_library(regex):
    assert screen("regex", regex) is None


def test_a_schemas_patterns_are_read_as_regexes():
    for schema in [{"type": "string", "pattern": "^a{1000000}$"},
                   {"type": "object", "properties": {"a": {"type": "array", "items": {"pattern": "x{200000,}"}}}},
                   {"type": "object", "patternProperties": {"^k{1000000}$": {"type": "integer"}}}]:
        refusal = screen("json_schema", json.dumps(schema))
        assert refusal is not None and "MAX_REGEX_REPEAT" in refusal, schema
    # Not a pattern: a description, an enum value, a length limit (which the library handles cheaply).
    for schema in [{"type": "string", "description": "a{1000000}"}, {"enum": ["a{1000000}"]},
                   {"type": "object", "default": {"pattern": "a{1000000}"}},
                   {"type": "string", "maxLength": 1000000}, {"type": "string", "pattern": "^[0-9]{5}$"}]:
        assert screen("json_schema", json.dumps(schema)) is None, schema


def test_lark_grammars_are_left_to_the_library():
    assert screen("grammar", 'start: /a{1000000}/') is None


@pytest.mark.slow
def test_what_the_screen_refuses_the_library_refuses_too(tiny_model_path: Path):
    """The screen only makes refusals cheaper: each schema it finds endless, llguidance alone refuses too, at
    compile time where every document is forced into the cycle, else once the output has entered it (the
    screen refuses those before the request runs, where the library would fail it at a step)."""
    import llguidance
    from transformers import AutoTokenizer

    from worker.model.structured.compile import JSON_OPTIONS, GrammarLimits, first_step_error
    from worker.model.structured.grammar import _llg_tokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer = _llg_tokenizer(hf, 49152, [2])
    entered = {"two-definitions": '{"x": 1, "start": {"b": {"a": {"b": '}
    for name, spec in ENDLESS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=GrammarLimits().quick().parser_limits())
        if name in entered:
            assert first_step_error(matcher, 49152) is None, name  # the library cannot tell in advance
            matcher.consume_tokens(hf.encode(entered[name], add_special_tokens=False))
        assert first_step_error(matcher, 49152) is not None, name
