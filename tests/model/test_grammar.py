"""The grammar compiler (worker/model/grammar.py): compiled once per distinct spec, off the caller's thread, errors
kept as values with llguidance's message; matchers advance independently; bitmasks match the grammar."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from worker.model.grammar import GrammarCompiler

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def compiled(compiler: GrammarCompiler, kind: str, spec: str):
    return compiler.submit(kind, spec).result(timeout=30)


def allowed_ids(bitmask_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def test_compiles_off_the_calling_thread_once_per_spec(compiler):
    threads = []
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def compile_and_note(kind, text):
        threads.append(threading.current_thread().name)
        return original(kind, text)

    original = compiler._compile
    compiler._compile = compile_and_note
    try:
        first = compiler.submit("json_schema", spec)
        assert first.result(timeout=30).error is None
        before = compiler.num_compiled
        again = [compiler.submit("json_schema", spec) for _ in range(5)]
    finally:
        del compiler._compile
    assert all(future is first for future in again)  # cached: the same future, nothing compiled again
    assert compiler.num_compiled == before
    assert threads == [threads[0]] and threads[0].startswith("grammar")


def test_the_cache_keeps_the_most_recent_specs(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, (EOS,), cache_size=2)
    try:
        a, b, c = (small.submit("regex", r) for r in ("a+", "b+", "c+"))
        assert small.submit("regex", "c+") is c and small.submit("regex", "b+") is b
        assert small.submit("regex", "a+") is not a  # evicted, compiled again
        a.result(timeout=30)
    finally:
        small.close()


@pytest.mark.parametrize("kind, spec, message", [
    ("json_schema", '{"type": "strin"}', "Invalid type: strin"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("json_schema", '{"not": {"type": "string"}}', "Unimplemented keys"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}', "minimum (5) is greater than maximum (2)"),
    ("json_schema", "[1, 2]", ""),
    ("regex", "((", "unclosed group"),
    ("grammar", "start: foo", 'unknown name: "foo"'),
])
def test_a_grammar_the_library_refuses_is_an_error_value_with_its_message(compiler, kind, spec, message):
    result = compiled(compiler, kind, spec)
    assert result.matcher is None and result.error and message in result.error
    assert compiler.submit(kind, spec).result() is result  # refusals are cached too


def test_matchers_advance_independently_and_end_when_the_grammar_is_complete(compiler, tokenizer):
    grammar = compiled(compiler, "json_schema", json.dumps({"enum": ["yes", "no"]}))
    first, second = compiler.matcher(grammar), compiler.matcher(grammar)
    ids = tokenizer.encode('"yes"', add_special_tokens=False)
    for token_id in ids[:-1]:
        assert first.advance(token_id) is False
    assert first.advance(ids[-1]) is True  # nothing can follow: the request ends without an EOS
    bitmask, dead = compiler.fill_bitmask([second, first])
    assert dead == []
    assert allowed_ids(bitmask[1]) == {EOS}  # a finished grammar allows only EOS
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert quote in allowed_ids(bitmask[0]) and EOS not in allowed_ids(bitmask[0])
    with pytest.raises(RuntimeError, match="refused"):
        second.advance(tokenizer.encode("maybe", add_special_tokens=False)[0])


def test_a_complete_grammar_that_could_go_on_ends_at_eos(compiler, tokenizer):
    matcher = compiler.matcher(compiled(compiler, "regex", "[0-9]+"))
    assert matcher.advance(tokenizer.encode("42", add_special_tokens=False)[0]) is False
    bitmask, _ = compiler.fill_bitmask([matcher])
    assert EOS in allowed_ids(bitmask[0])
    assert matcher.advance(EOS) is True


def test_json_is_written_on_one_line_with_spaces_after_separators(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}
    grammar = compiled(compiler, "json_schema", json.dumps(schema))
    for text, ok in (('{"a": 1, "b": true}', True), ('{"a":1,"b":true}', False), ('{\n"a": 1, "b": true}', False)):
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ok:
            assert [matcher.advance(t) for t in ids][-1] is True
        else:
            with pytest.raises(RuntimeError):
                for t in ids:
                    matcher.advance(t)
