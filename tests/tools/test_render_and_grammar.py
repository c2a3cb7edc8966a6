"""Tools in the prompt (the generic format on SmolLM2's template, the template's own where it has one) and the
forced call's grammar: every output the grammar lets a model write parses into calls whose arguments satisfy
their schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from worker.tools.grammar import JSON_OPTIONS, tool_call_grammar
from worker.tools.parse import ToolCallParser
from worker.tools.render import render_chat, template_renders_tools, tools_section

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
    "additionalProperties": False}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
]


def test_generic_format_lists_the_tools_and_writes_calls_and_results_in_tags():
    messages, tools = render_chat(HISTORY, [WEATHER, CLOCK], native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == tools_section([WEATHER, CLOCK])
    assert json.dumps(WEATHER) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n14:00\n</tool_response>"
    # A system message of the caller's keeps its text, the section after it; without tools, no section.
    with_system, _ = render_chat([{"role": "system", "content": "Be brief."}, *HISTORY], [WEATHER], native=False)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    without, _ = render_chat(HISTORY, None, native=False)
    assert without == messages[1:]


def test_smollm2s_template_renders_the_generic_format(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert not template_renders_tools(tokenizer.chat_template)
    messages, tools = render_chat(HISTORY, [WEATHER], native=False)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<|im_start|>assistant\n")
    assert "<tool_response>\n18 C\n</tool_response>" in text


def test_a_template_with_tools_gets_them_and_the_calls_as_objects():
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}<tool_call>"
    assert template_renders_tools(template) and not template_renders_tools("{{ messages }}")
    assert template_renders_tools({"default": "{{ messages }}", "tool_use": template})
    assert not template_renders_tools({"default": "{{ messages }}"}) and not template_renders_tools(None)
    messages, tools = render_chat(HISTORY, [WEATHER], native=True)
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris",
                                                                                              "unit": "C"}
    assert messages[2] == HISTORY[2] and HISTORY[1]["tool_calls"][0]["function"]["arguments"].startswith("{")


def test_the_grammar_uses_the_structured_output_json_options():
    from worker.model.structured.compile import JSON_OPTIONS as STRUCTURED

    assert JSON_OPTIONS == STRUCTURED


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True])
def test_every_output_the_grammar_admits_is_a_valid_call(smollm2_path, parallel):
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    vocab = len(tokenizer)
    llg = llguidance.hf.from_tokenizer(tokenizer, vocab, [tokenizer.eos_token_id])
    functions = [(t["function"]["name"], t["function"]["parameters"]) for t in (WEATHER, CLOCK)]
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(functions, parallel))
    schemas = dict(functions)
    rng = random.Random(7)
    for _ in range(4):
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        tokens = []
        while not matcher.is_stopped() and len(tokens) < 300:
            mask = np.zeros((1, (vocab + 31) // 32), np.int32)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].nonzero()[0].tolist()
            # A random model: any allowed token, ending (EOS) only now and then.
            choice = rng.choice(allowed)
            if choice == tokenizer.eos_token_id and len(allowed) > 1 and rng.random() < 0.7:
                choice = rng.choice([t for t in allowed if t != choice])
            assert matcher.consume_token(choice)
            tokens.append(choice)
            if choice == tokenizer.eos_token_id:
                break
        text = tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id])
        parser = ToolCallParser(frozenset(schemas), parallel)
        parser.feed(text)
        parser.finish()
        assert parser.calls and parser.content == "", text
        assert parallel or len(parser.calls) == 1
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
